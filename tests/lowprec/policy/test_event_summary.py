"""Event summaries name the sites an event acted on (the first few, then `+N more`) and the
reason, in the one wording every place shows: `Event.summary` (the run's summary, the
torchtitan log), the run's MLflow note and `lowprec report` (test_report.py)."""

from __future__ import annotations

from lowprec.policy.events import Event, EventKind, describe, site_list
from lowprec.tracking.report_sources import events_tags

SITES = tuple(f"blocks.{i}.{s}" for i in range(8) for s in ("attn.qkv", "mlp.fc"))   # 16 sites


def test_a_replay_names_its_first_sites_the_count_of_the_rest_and_the_reason():
    e = Event(30, EventKind.REPLAY, SITES, reason="replayed with 16 site(s) in high precision: clean")
    assert e.summary() == ("step 30 replay: blocks.0.attn.qkv, blocks.0.mlp.fc, blocks.1.attn.qkv +13 more "
                           "[replayed with 16 site(s) in high precision: clean]")


def test_moves_are_named_once_when_all_sites_made_the_same_move_and_per_site_otherwise():
    promote = Event(60, EventKind.PROMOTE, SITES[:4], dict.fromkeys(SITES[:4], "bf16"),
                    dict.fromkeys(SITES[:4], "fp8_tensorwise"), "stable for 60 steps", stage="mlp_fp8")
    assert promote.summary() == ("step 60 promote mlp_fp8: blocks.0.attn.qkv, blocks.0.mlp.fc, blocks.1.attn.qkv "
                                 "+1 more bf16->fp8_tensorwise [stable for 60 steps]")
    a, b = SITES[:2]
    fallback = Event(70, EventKind.ROLLBACK, (a, b), {a: "nvfp4", b: "fp8_tensorwise"}, {a: "fp8_tensorwise", b: "bf16"},
                     "global signal: loss_gap", stage="late")
    assert describe(fallback) == (f"{a} nvfp4->fp8_tensorwise, {b} fp8_tensorwise->bf16 "
                                  "[global signal: loss_gap]")
    quarantine = Event(80, EventKind.QUARANTINE, (a,), reason="failed 2 times")
    assert quarantine.summary() == f"step 80 quarantine: {a} [failed 2 times]"


def test_an_event_without_sites_says_its_reason():
    rewind = Event(90, EventKind.REWIND, reason="rewind: loss_spike for 2 steps in a row, not precision's")
    assert rewind.summary() == "step 90 rewind: [rewind: loss_spike for 2 steps in a row, not precision's]"
    assert site_list(["a", "b"]) == "a, b" and site_list(list("abcde"), 2) == "a, b +3 more"


def test_the_mlflow_note_shows_each_event_in_the_same_words():
    events = [Event(30, EventKind.REPLAY, SITES, reason="replayed: clean"),
              Event(30, EventKind.SKIP_STEP, reason="loss_spike: step skipped")]
    note = events_tags(events, "run")["mlflow.note.content"]
    assert f"| 30 | replay |  | {describe(events[0])} |" in note
    assert "blocks.1.attn.qkv +13 more [replayed: clean]" in note
    assert "| 30 | skip_step |  | [loss_spike: step skipped] |" in note
