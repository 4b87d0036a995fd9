"""The tests' rank server (tests/rank_forks.py): a forked rank ends, prints and sees its environment
as the `python -u SCRIPT` torchrun would have started, so that the launch tests that use it test
what a user's torchrun job does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

SCRIPT = '''
import os, signal, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "var", os.environ.get("THE_VAR"), "first", sys.path[0])
print("extra", os.environ["EXTRA"] in sys.path)
sys.stderr.write("unbuffered\\n")
how = sys.argv[1]
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "raise":
    raise ValueError("from the rank")
if how == "wait":
    print("waiting", flush=True)
    time.sleep(60)
sys.exit(int(how))
'''


def _run(rank_forks, tmp_path, how, **popen):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    extra = tmp_path / "extra"
    env = rank_forks.env({**os.environ, "THE_VAR": "set", "EXTRA": str(extra), "PYTHONPATH": str(extra)})
    return subprocess.Popen([sys.executable, *rank_forks.rank(script, how)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_a_forked_rank_exits_prints_and_sees_its_environment_as_a_fresh_one(rank_forks, tmp_path):
    proc = _run(rank_forks, tmp_path, "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert f"argv ['3'] cwd {tmp_path} var set first {tmp_path}" in out and "extra True" in out
    assert err == "unbuffered\n"
    proc = _run(rank_forks, tmp_path, "raise")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "ValueError: from the rank" in err


def test_a_rank_killed_by_a_signal_ends_its_client_by_that_signal(rank_forks, tmp_path):
    proc = _run(rank_forks, tmp_path, "kill")
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # torchrun's SIGTERM to the client reaches the rank; the client ends as the rank did
    proc = _run(rank_forks, tmp_path, "wait")
    assert proc.stdout.readline().startswith("argv")
    proc.stdout.readline()
    assert proc.stdout.readline() == "waiting\n"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
