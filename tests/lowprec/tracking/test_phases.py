"""The lap clocks and the goodput ledger (no model): laps add up to wall time, overrides,
outcomes sorted into buckets, a rewind moving the undone steps' work to `redone`."""

import time

import pytest

from lowprec.tracking import phases
from lowprec.tracking.phases import (ALWAYS_WASTED, NULL_CLOCK, Bucket, CpuLapClock, GoodputLedger, PassOutcome,
                                     Phase)
from lowprec.tracking.telemetry import Telemetry, TelemetryConfig


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class FakeTime:
    """A host clock that moves only when told to: the laps' arithmetic checked exactly."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_cpu_laps_add_up_to_the_wall_time_and_split_by_phase(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(phases, "time", fake)
    clock = CpuLapClock()
    fake.now += 0.02
    clock.lap(Phase.DATA)
    fake.now += 0.04
    clock.lap(Phase.FORWARD)
    clock.end_pass()
    fake.now += 0.01
    clock.lap(Phase.DATA)
    clock.end_pass()
    first, second = clock.flush()
    assert first == {Phase.DATA: pytest.approx(0.02, abs=1e-12), Phase.FORWARD: pytest.approx(0.04, abs=1e-12)}
    assert second == {Phase.DATA: pytest.approx(0.01, abs=1e-12)}
    assert sum(first.values()) + sum(second.values()) == pytest.approx(fake.now - 100.0, abs=1e-12)
    assert clock.flush() == []   # flushed once


def test_cpu_laps_run_on_the_real_host_clock():
    """On the real clock the laps of a pass add up to the wall time between its first and last lap."""
    clock = CpuLapClock()
    t0 = time.perf_counter()
    busy(0.005)
    clock.lap(Phase.DATA)
    busy(0.005)
    clock.lap(Phase.FORWARD)
    (laps,) = clock.flush(include_open=True)
    assert laps[Phase.DATA] >= 0.005 and laps[Phase.FORWARD] >= 0.005
    assert sum(laps.values()) <= time.perf_counter() - t0 + 1e-3


def test_override_books_every_lap_as_the_override_phase():
    clock = CpuLapClock()
    clock.override = Phase.RECOVERY
    busy(0.005)
    clock.lap(Phase.FORWARD)
    busy(0.005)
    clock.lap(Phase.BACKWARD)
    clock.override = None
    clock.lap(Phase.MONITOR)
    (d,) = clock.flush(include_open=True)
    assert set(d) == {Phase.RECOVERY, Phase.MONITOR} and d[Phase.RECOVERY] >= 0.009


def test_null_clock_keeps_no_state():
    NULL_CLOCK.override = Phase.RECOVERY
    assert NULL_CLOCK.override is None
    NULL_CLOCK.lap(Phase.DATA)
    NULL_CLOCK.end_pass()
    assert NULL_CLOCK.flush(include_open=True) == []


def test_ledger_sorts_each_pass_by_outcome():
    led = GoodputLedger()
    led.add_outside(Bucket.STARTUP, 2.0)
    work = {Phase.DATA: 0.1, Phase.FORWARD: 0.4, Phase.BACKWARD: 0.5}
    assert led.add_pass(0, work, PassOutcome.APPLIED, tokens=100, flops={"bf16": 10.0}) == 0.0
    assert led.add_pass(1, {**work, Phase.CHECKPOINT: 0.3}, PassOutcome.APPLIED, tokens=100,
                        flops={"fp8_tensorwise": 5.0}) == pytest.approx(0.3)
    assert led.add_pass(2, {**work, Phase.RECOVERY: 2.0}, PassOutcome.SKIPPED, tokens=100) == pytest.approx(3.0)
    b = led.buckets
    assert b[Bucket.PRODUCTIVE] == pytest.approx(2.0) and b[Bucket.CHECKPOINT] == pytest.approx(0.3)
    assert b[Bucket.SKIPPED] == pytest.approx(1.0) and b[Bucket.RECOVERY] == pytest.approx(2.0)
    assert led.wall == pytest.approx(2.0 + 2.0 + 0.3 + 1.0 + 2.0)
    assert led.goodput == pytest.approx(2.0 / led.wall)
    assert led.trained_tokens == 200
    assert led.flops_by_format() == {"bf16": 10.0, "fp8_tensorwise": 5.0}


def test_a_rewind_moves_the_undone_steps_and_itself_to_redone_and_its_restore_to_recovery():
    led = GoodputLedger()
    for s in range(10):
        led.add_pass(s, {Phase.FORWARD: 1.0}, PassOutcome.APPLIED, tokens=10, flops={"bf16": 1.0})
    wasted = led.add_pass(10, {Phase.FORWARD: 1.0, Phase.RECOVERY: 0.5}, PassOutcome.REWOUND, tokens=10,
                          rewound_to=6)
    assert wasted == pytest.approx(1.0 + 0.5 + 4.0)   # the pass, the restore, steps 6..9
    assert led.buckets[Bucket.REDONE] == pytest.approx(5.0) and led.buckets[Bucket.RECOVERY] == pytest.approx(0.5)
    assert led.buckets[Bucket.PRODUCTIVE] == pytest.approx(6.0)
    assert led.trained_tokens == 60 and led.flops_by_format() == {"bf16": 6.0}
    for s in range(6, 8):   # redone: the steps count again once
        led.add_pass(s, {Phase.FORWARD: 1.0}, PassOutcome.APPLIED, tokens=10)
    assert led.trained_tokens == 80 and led.buckets[Bucket.PRODUCTIVE] == pytest.approx(8.0)


def test_every_always_wasted_phase_has_a_bucket_and_no_step_phase_does():
    assert set(ALWAYS_WASTED) == {Phase.RECOVERY, Phase.EVAL, Phase.CHECKPOINT, Phase.LR_PROBE,
                                  Phase.TRACKING}
    assert all(isinstance(b, Bucket) for b in ALWAYS_WASTED.values())


def test_telemetry_windows_and_summary_from_laps(monkeypatch):
    from lowprec.tracking import telemetry
    fake = FakeTime()
    monkeypatch.setattr(phases, "time", fake)
    monkeypatch.setattr(telemetry, "time", fake)
    tele = Telemetry(TelemetryConfig(energy="off", mfu=False), started=fake.now - 1.0)
    tele.begin()
    assert tele.ledger.buckets[Bucket.STARTUP] == pytest.approx(1.0)
    for step in range(4):
        fake.now += 0.01
        tele.clock.lap(Phase.DATA)
        fake.now += 0.03
        tele.clock.lap(Phase.FORWARD)
        tele.end_pass(step, PassOutcome.APPLIED if step != 2 else PassOutcome.SKIPPED, tokens=1000)
        if step % 2 == 1:
            w = tele.window(step)
            assert w["time/window_s"] == pytest.approx(w["time/data_s"] + w["time/forward_s"])
            assert w["time/data_s"] == pytest.approx(0.02)
            assert w["throughput/tokens_per_s"] == pytest.approx((2000 if step == 1 else 1000) / w["time/window_s"])
    out = tele.finish()
    assert out["telemetry/trained_tokens"] == 3000
    assert out["telemetry/bucket/skipped_s"] == pytest.approx(0.04)
    assert out["telemetry/tokens_per_s"] == pytest.approx(3000 / out["telemetry/wall_s"])
    assert out["telemetry/goodput"] == pytest.approx(out["telemetry/bucket/productive_s"] / out["telemetry/wall_s"])
    assert "telemetry/energy_j" not in out and "telemetry/mfu" not in out   # both off


def test_telemetry_config_is_checked_at_load():
    from lowprec.base.parse import ConfigError
    with pytest.raises(ConfigError, match="grid_g_per_kwh"):
        TelemetryConfig(grid_g_per_kwh=-1)
    with pytest.raises(ConfigError, match="energy"):
        TelemetryConfig(energy="rapl")
