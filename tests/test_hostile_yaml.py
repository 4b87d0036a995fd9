"""Hostile YAML (issue 56): alias bombs, deep nesting, duplicate keys, huge files and values
that make no sense, in the default config, the gate files and the suite file.

Every input ends in exit 2 and one line on stderr (in process, through the CLI's `main`),
within a memory bound (tracemalloc's peak) and a time bound (hypothesis's deadline, generous:
the point is "not minutes", not a speed figure), and creates nothing: no run folder, no
MLflow store. A few cases go through a real `lowprec run` process under OS limits (address
space and CPU seconds), which is what a user meets.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tracemalloc
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = (ROOT / "experiments/configs/default.yaml").read_text()
GATE_TEXTS = {p.name: p.read_text() for p in sorted((ROOT / "gates").glob("*.yaml"))}
SUITES = (ROOT / "eval_suites/suites.yaml").read_text()
PEAK_BYTES = 96 << 20    # per input: the reader refuses before it builds; a bomb built would be GBs
CAMPAIGN = settings(max_examples=15, deadline=timedelta(seconds=20), derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


def _bomb(levels: int, fan: int) -> str:
    """A billion-laughs value: `levels` anchors, each `fan` aliases of the one before."""
    lines = ["  - &l0 [" + ", ".join(["lol"] * fan) + "]"]
    lines += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return "\n".join(lines)


def _fqns_bomb(levels: int, fan: int) -> str:
    """The default config with a bomb as `keep_high_precision[0].fqns`, where issue 56 put it: a
    refusal that quotes the value (as d588cb5's did) expands it."""
    items = ["&l0 [" + ", ".join(["lol"] * fan) + "]"]
    items += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return DEFAULT.replace("{fqns: [lm_head]}", "{fqns: [" + ", ".join(items) + "]}")


# Each hostile piece is (name, text to insert at the top level, text to replace a line with).
def _hostile_pieces(top_key: str) -> st.SearchStrategy:
    bomb = st.builds(lambda n, f: f"{top_key}_bomb:\n{_bomb(n, f)}\n", st.integers(5, 9), st.integers(8, 12))
    flow_deep = st.builds(lambda d: f"{top_key}_deep: " + "[" * d + "]" * d + "\n", st.integers(70, 20_000))
    block_deep = st.builds(lambda d: f"{top_key}_deep:\n" + "".join("  " * i + f"k{i}:\n" for i in range(d))
                           + "  " * d + "leaf\n", st.integers(70, 400))
    huge = st.builds(lambda n: f"{top_key}_huge: " + "x" * n + "\n", st.integers(4 << 20, 5 << 20))
    return st.one_of(bomb, flow_deep, block_deep, huge)   # a bomb is also what crosses max_nodes


def _duplicate(text: str, rnd) -> str | None:
    """`text` with one of its `key: ...` lines written twice, right after itself: a duplicate key
    at that line's level. None where the copy does not parse as YAML (a flow mapping's inner line)."""
    lines = text.splitlines()
    keyed = [i for i, ln in enumerate(lines) if re.match(r"\s*[A-Za-z_]\w*:(\s|$)", ln)]
    i = rnd.choice(keyed)
    out = "\n".join(lines[:i + 1] + [lines[i]] + lines[i + 1:]) + "\n"
    try:
        yaml.safe_load(out)   # PyYAML itself keeps the last of two keys without a word
    except yaml.YAMLError:
        return None
    return out


@st.composite
def hostile_text(draw, base: str, top_key: str) -> str:
    kind = draw(st.sampled_from(["piece_end", "piece_start", "duplicate"]))
    if kind == "duplicate":
        out = _duplicate(base, draw(st.randoms(use_true_random=False)))
        if out is not None:
            return out
    piece = draw(_hostile_pieces(top_key))
    return base + "\n" + piece if kind != "piece_start" else piece + base


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    from lowprec.cli import main

    tracemalloc.start()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    out, err = capsys.readouterr()
    assert rc == 2, f"exit {rc}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err + out
    assert err.count("\n") == 1 and len(err) < 1200, err[:3000]
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB for one input"
    return err


@pytest.fixture()
def here(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _nothing_created(folder: Path, *keep: str) -> None:
    left = sorted(p.name for p in folder.iterdir() if p.name not in keep)
    assert left == [], f"created {left}"


@CAMPAIGN
@given(text=hostile_text(DEFAULT, "model"))
def test_a_hostile_default_config_exits_2_with_one_line(here, capsys, text):
    cfg = here / "c.yaml"
    cfg.write_text(text)
    _one_line_exit_2(capsys, ["plan", str(cfg)])
    _nothing_created(here, "c.yaml")


@CAMPAIGN
@given(name=st.sampled_from(sorted(GATE_TEXTS)), data=st.data())
def test_a_hostile_gate_file_exits_2_with_one_line(here, capsys, name, data):
    gates = here / "gates.yaml"
    gates.write_text(data.draw(hostile_text(GATE_TEXTS[name], "gates")))
    store = here / "no-store.db"
    err = _one_line_exit_2(capsys, ["gate", "--baseline", "a" * 32, "--candidate", "b" * 32, "--gates", str(gates),
                                    "--tracking-uri", f"sqlite:///{store}"])
    assert str(gates) in err   # refused as a gate file, before any store is opened
    _nothing_created(here, "gates.yaml")


@CAMPAIGN
@given(text=hostile_text(SUITES, "shift"))
def test_a_hostile_suite_file_is_one_config_error(text):
    from lowprec.base.parse import ConfigError
    from lowprec.evals.suite import load_suites

    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            load_suites(text, "suites.yaml")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "\n" not in str(e.value) and len(str(e.value)) < 1200, str(e.value)[:3000]
    assert peak < PEAK_BYTES


@pytest.mark.parametrize("edit, words", [
    (lambda t: t + "\ntrain:\n  lr: 0.1\n", "train: appears twice in the same mapping"),
    (lambda t: t.replace("check_every: 10", "check_every: 10\n  check_every: 20"), "rollout.check_every: appears twice"),
    (lambda t: t.replace("steps: 300", "steps: 1000000000000000000000000000000"), "train.steps: expected an integer"),
    (lambda t: t.replace("steps: 300", "steps: 20000000000"), "train.steps: expected an integer <= 1,000,000,000"),
    (lambda t: t.replace("loss_gap: 0.03", "loss_gap: 0.03, spike_sigmas: .inf"),
     "rollout.thresholds.spike_sigmas: expected a number, found the number inf"),
    (lambda t: t.replace("lr: 3.0e-3", "lr: .nan"), "train.lr: expected a number, found the number nan"),
    (lambda t: t.replace("{fqns: [lm_head]}", "{fqns: [" + "x" * 100_000 + "]}"), "(100,001 characters)"),
    (lambda t: t.replace("suite: default", "suite: " + "s" * 50_000), "eval.suite: unknown suite 'sss"),
    (lambda t: t.replace("gates: inloop", "gates: " + "g/" * 5000), "eval.gates: gate file 'g/g/"),
    (lambda t: t.replace("      ladder: [fp8_tensorwise, bf16]\n", ""), "rollout.stages[0].format: stage 'mlp_fp8'"),
    (lambda t: "model: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML at line 1"),
    (lambda t: "model:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(100)), "more than 64 levels deep"),
    (lambda t: _fqns_bomb(6, 10), "holds more than 100,000 values once its aliases"),
])
def test_each_hostile_config_is_refused_with_its_key_path(here, capsys, edit, words):
    """The cases issue 56 found, each a refusal in one line that names the key (on d588cb5: a
    second `train:` and `.inf` were accepted, 10**30 steps too, deep nesting was a RecursionError
    traceback, a long gate path an OSError traceback, the ladder refusal had no key path, and a
    quoted value was printed whole)."""
    cfg = here / "c.yaml"
    cfg.write_text(edit(DEFAULT))
    err = _one_line_exit_2(capsys, ["plan", str(cfg)])
    assert words in err, err


def test_the_reader_expands_merges_and_custom_tags_and_uses_the_c_loader():
    from lowprec.base import yaml_read
    from lowprec.evals.tasks import Function, read_task_yaml

    doc = yaml_read.load_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n")
    assert doc == {"base": {"x": 1, "y": 2}, "other": {"x": 3, "y": 2}}   # a merge key is no duplicate
    task = read_task_yaml("process_results: !function utils.process\n")
    assert isinstance(task["process_results"], Function) and task["process_results"] == "utils.process"
    if yaml.__with_libyaml__:
        assert issubclass(yaml_read._loader({}), yaml.CSafeLoader)


_LIMITS = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
           "resource.setrlimit(resource.RLIMIT_CPU, (60, 60)); from lowprec.cli import main; "
           "sys.exit(main(sys.argv[1:]))")


def test_lowprec_run_on_a_hostile_config_creates_nothing(here):
    """A real `lowprec run` process, under 2 GiB of address space and 60 CPU seconds: exit 2,
    one line, no run folder, no MLflow store (d588cb5: a bomb ran 300 s into 2.3 GB)."""
    cfg = here / "c.yaml"
    cfg.write_text(_fqns_bomb(9, 10))
    r = subprocess.run([sys.executable, "-c", _LIMITS, "run", str(cfg), "--out", str(here / "run")],
                       capture_output=True, text=True, timeout=300, cwd=here,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    _nothing_created(here, "c.yaml")
