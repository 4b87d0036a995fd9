"""One writer per file or folder (`lowprec.base.writer_lock`): a second taker is refused with the
holder's pid and host, the lock is free the moment its holder is SIGKILLed, an exclusive event
log refuses a second writer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lowprec.base.writer_lock import WriterBusyError, WriterLock, holder
from lowprec.policy.events import EventLog


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    path = tmp_path / "x.lock"
    assert holder(path) is None and not path.exists()   # asking creates nothing
    lock = WriterLock.take(path, "the folder x")
    with pytest.raises(WriterBusyError) as e:   # in this process too: one writer, full stop
        WriterLock.take(path, "the folder x")
    who = e.value.holder
    assert (who.pid, who.host) == (os.getpid(), socket.gethostname())
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(e.value) and "the folder x" in str(e.value)
    assert holder(path) == who
    lock.release()
    assert holder(path) is None
    WriterLock.take(path, "the folder x").release()   # free again


def test_a_killed_holder_frees_the_lock_at_once(tmp_path):
    path = tmp_path / "x.lock"
    code = ("import sys, time; from lowprec.base.writer_lock import WriterLock\n"
            f"lock = WriterLock.take({str(path)!r}, 'x'); print('held', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        who = holder(path)
        assert who is not None and who.pid == p.pid
        with pytest.raises(WriterBusyError, match=f"pid {p.pid}"):
            WriterLock.take(path, "x")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    t0 = time.monotonic()
    WriterLock.take(path, "x").release()   # no stale lock: the OS let go when the process died
    assert time.monotonic() - t0 < 1.0


def test_release_with_remove_and_the_path_check(tmp_path):
    path = tmp_path / "x.lock"
    lock = WriterLock.take(path, "x")
    lock.release(remove=True)
    assert not path.exists()
    lock.release()   # idempotent
    with WriterLock.take(path, "x") as again:
        assert again.held and path.exists()
    assert not again.held


def test_an_exclusive_event_log_has_one_writer(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", exclusive=True)
    with pytest.raises(WriterBusyError, match="the event log"):
        EventLog(tmp_path / "events.jsonl", exclusive=True)
    EventLog(tmp_path / "events.jsonl").read()   # a reader is no writer
    log.close()
    EventLog(tmp_path / "events.jsonl", exclusive=True).close()
