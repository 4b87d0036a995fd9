"""lowprec.runtime.trainer.stop_request: what SIGINT and SIGTERM do to a `lowprec run` in this
process (the whole run, stopped and resumed, is in test_kill_resume.py; a job's ranks agreeing
in test_parallel_run.py)."""

from __future__ import annotations

import signal

import pytest

from lowprec.runtime.trainer.stop_request import STOP_SIGNALS, RunStopped, StopRequest


def test_the_first_signal_is_a_request_said_once_and_the_handlers_are_put_back():
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    said = []
    with StopRequest(said.append) as stop:
        assert stop.requested is None and stop.agreed(3) is None
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)   # a repeated SIGTERM changes nothing (the stop is under way)
        assert stop.requested == signal.SIGTERM and stop.agreed(3) == signal.SIGTERM
    assert said == ["SIGTERM: stopping at the next step, with a checkpoint there; Ctrl-C again stops at once, "
                    "without one"]
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_a_second_ctrl_c_stops_at_once_in_one_process_and_changes_nothing_in_a_job():
    with StopRequest() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    for rank in (0, 1):   # a job's ranks: torchrun's agent passes on the Ctrl-C that reached them already
        said = []
        with StopRequest(said.append, rank=rank) as stop:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert stop.requested == signal.SIGINT and said == []   # said once the ranks agree on a step
            assert stop.agreed(7) == signal.SIGINT
        assert said == (["SIGINT: every rank stops at step 7, with a checkpoint there"] if rank == 0 else [])


def test_the_exit_code_is_the_shells():
    assert RunStopped(signal.SIGINT, 7).exit_code == 130 and RunStopped(signal.SIGTERM, 7).exit_code == 143
    assert str(RunStopped(signal.SIGTERM, 12)) == "stopped by SIGTERM at step 12"


def test_within_interrupting_a_signal_stops_at_once_past_a_catch_all_and_not_in_a_job():
    said, ran = [], []
    with StopRequest(said.append) as stop:
        with pytest.raises(RunStopped) as e:
            with stop.interrupting(48):
                try:   # an evaluator's own catch-all does not hold the stop
                    signal.raise_signal(signal.SIGTERM)
                except Exception:
                    ran.append("caught")
                ran.append("went on")
        assert (e.value.signum, e.value.step, ran) == (signal.SIGTERM, 48, [])
        assert said == ["SIGTERM: stopping now, during the final eval; --resume redoes it"]
        with pytest.raises(RunStopped):   # the signal came before: nothing starts
            with stop.interrupting(48):
                ran.append("started")
        assert ran == []
    with StopRequest(rank=0) as stop:   # a job's ranks evaluate together: the eval goes on
        with stop.interrupting(48):
            signal.raise_signal(signal.SIGTERM)
            ran.append("went on")
        assert stop.requested == signal.SIGTERM and ran == ["went on"]


def test_a_line_the_handler_cannot_write_never_loses_the_stop():
    """The signal came while the main thread wrote to the same stream (Python's buffered streams
    refuse the handler's reentrant write with RuntimeError): the request stands, the eval stops."""
    def busy(text):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    with StopRequest(busy) as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
    with StopRequest(busy) as stop:
        with pytest.raises(RunStopped):
            with stop.interrupting(5):
                signal.raise_signal(signal.SIGINT)
