"""Text for people carries no float noise: a value computed in floating point (0.8 + 0.16 is
0.9600000000000001, str() writes every digit) reaches the run's summary, its MLflow note, the
report's notes and `lowprec report`'s event list at four significant digits."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from lowprec.policy.events import Event, EventKind
from lowprec.runtime.trainer.loop import RunResult
from lowprec.runtime.trainer.run_summary import summary_text
from lowprec.tracking.records import number, tidy_numbers
from lowprec.tracking.report_sources import ReportData, events_tags
from lowprec.tracking.report_timeline import _notes, reason_text

NOISY = 0.8 + 0.16                    # 0.9600000000000001: what a computed fraction looks like
GAP = 0.1 + 0.2                       # 0.30000000000000004
SITE = "blocks.0.mlp.fc"


def _events() -> list[Event]:
    return [Event(40, EventKind.FALLBACK, (SITE,), {SITE: "fp8_tensorwise"}, {SITE: "bf16"},
                  f"loss_gap: the window trained again closes {NOISY} of the gap", {"input/saturated_frac": GAP},
                  "mlp_fp8"),
            Event(41, EventKind.REWIND, (), {}, {}, f"rewind after loss_gap {GAP}",
                  {"loss_gap": {"gap": GAP, "threshold": 0.03}, "to_step": 30})]


def test_the_noise_is_there_to_remove():
    assert str(NOISY) == "0.9600000000000001" and str(GAP) == "0.30000000000000004"
    assert str(NOISY) in _events()[0].summary()   # the reason as the policy wrote it


def test_the_run_summary_prints_no_float_noise(tmp_path: Path):
    res = RunResult(losses=[1.0, 0.5], seconds_per_step=0.1, events=_events())
    text = summary_text("r", res, SimpleNamespace(baseline=None), tmp_path, None, "sqlite:///x.db")
    assert "closes 0.96 of the gap" in text and "[rewind after loss_gap 0.3]" in text, text
    assert "0000000" not in text


def test_the_mlflow_note_and_the_report_notes_print_no_float_noise():
    note = events_tags(_events(), "r")["mlflow.note.content"]
    assert "closes 0.96 of the gap" in note and "0000000" not in note, note
    data = ReportData("r", {SITE: "fp8_tensorwise"}, 0, _events(), {}, thresholds={"saturated_frac": 0.01})
    notes = "\n".join(_notes(data))
    assert "input saturated_frac 0.3 > 0.01" in notes and "loss_gap 0.3 > 0.03" in notes, notes
    assert "0000000" not in notes
    assert reason_text(_events()[1]) == "rewind after loss_gap 0.3"


def test_numbers_and_tidy_numbers():
    assert number(NOISY) == "0.96" and number(3.1e-5) == "3.1e-05" and number([GAP, 2]) == "[0.3, 2]"
    assert number(7) == "7" and number(True) == "True"
    # integers, versions, short decimals and names with digits stay as written
    text = "step 40, torch 2.13.0, lr 0.0003, x1.2345678, blocks.10.mlp"
    assert tidy_numbers(text) == text
    assert tidy_numbers(f"loss {3.520367988700015} ({-GAP})") == "loss 3.52 (-0.3)"
