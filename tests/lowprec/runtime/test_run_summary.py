"""The telemetry lines of `lowprec run`'s summary: goodput, the wasted buckets, phases, and
time and energy per token against the baseline run."""

from lowprec.runtime.trainer.run_summary import telemetry_lines
from lowprec.tracking.phases import Bucket, Phase


def numbers(productive=6.0, startup=2.0, eval_s=2.0, tokens_per_s=1000.0, energy_per_token=0.002):
    t = {f"telemetry/bucket/{b.value}_s": 0.0 for b in Bucket}
    t.update({f"telemetry/phase/{p.value}_s": 0.0 for p in Phase})
    t["telemetry/bucket/productive_s"], t["telemetry/bucket/startup_s"] = productive, startup
    t["telemetry/bucket/eval_s"] = eval_s
    t["telemetry/phase/forward_s"], t["telemetry/phase/backward_s"] = 2.0, 4.0
    t["telemetry/phase/eval_s"] = eval_s
    wall = productive + startup + eval_s
    t.update({"telemetry/wall_s": wall, "telemetry/goodput": productive / wall, "telemetry/tokens_per_s": tokens_per_s,
              "telemetry/step_tokens_per_s": tokens_per_s * 2, "telemetry/energy_j": 20.0,
              "telemetry/energy_per_token_j": energy_per_token, "telemetry/energy_measured": 0.0,
              "telemetry/mfu": 0.25})
    return t


def test_the_summary_says_where_the_time_went():
    text = "\n".join(telemetry_lines(numbers()))
    assert "time: 10.0 s, goodput 60% (productive 6.0 s; wasted: startup 2.0 s, eval 2.0 s)" in text
    assert "phases: backward 50%, forward 25%, eval 25%" in text
    assert "1,000 tokens/s (2,000 in the steps alone), MFU 25.0%" in text
    assert "energy (estimate): 0.02 kJ, 2 mJ/token" in text
    assert "against" not in text


def test_the_summary_compares_time_and_energy_per_token_with_the_baseline():
    base = numbers(tokens_per_s=2000.0, energy_per_token=0.001)
    text = "\n".join(telemetry_lines(numbers(), ("bf16-baseline", base)))
    assert "against bf16-baseline: time per token x2.00, in the steps x2.00, energy per token x2.00" in text
    assert telemetry_lines({}) == []
