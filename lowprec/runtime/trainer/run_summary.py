"""What `lowprec run` prints when a run ends: the run in a few lines (`summary_text`: loss and
its gap to the baseline, evals, FLOPs, events, where the files and the MLflow run are) and
where the time and energy went (`telemetry_lines`), against the baseline run's telemetry
when the config names one in MLflow."""

from __future__ import annotations

import math
from pathlib import Path

from lowprec.base.parse import ConfigError
from lowprec.tracking.records import tidy_numbers

__all__ = ["summary_text", "telemetry_lines"]


def summary_text(name: str, res, prepared, out: Path, run_id: str | None, uri: str) -> str:
    """The run in a few lines: loss and its gap to the baseline, evals, FLOPs, events, where it is."""
    tail = min(50, len(res.losses))
    kept = [s for s in range(len(res.losses) - tail, len(res.losses)) if math.isfinite(res.losses[s])]
    mean = sum(res.losses[s] for s in kept) / len(kept) if kept else math.nan   # skipped NaN steps trained nothing
    pace = f"{res.seconds_per_step * 1e3:.0f} ms/step" if res.seconds_per_step > 0 else "none trained in this process"
    lines = [f"run {name}: {len(res.losses)} steps, {pace}, "
             f"{res.rewinds} rewinds, {res.skipped} skipped steps, {len(res.events)} events"]
    line = f"  loss (mean of the last {tail} steps{f', {len(kept)} finite' if len(kept) < tail else ''}) {mean:.4f}"
    base = prepared.baseline
    if base and kept and all(s in base for s in kept):
        bl = sum(base[s] for s in kept) / len(kept)
        line += f"; baseline {bl:.4f}; gap {(mean - bl) / bl:+.2%}"
    lines.append(line)
    if res.flops_share:
        share = res.flops_share[max(res.flops_share)]
        lines.append("  GEMM FLOPs at the end: " + ", ".join(f"{k} {v:.0%}" for k, v in
                                                           sorted(share.items(), key=lambda kv: -kv[1])))
    if res.final_eval is not None:
        for task, metrics in sorted(res.final_eval.results.items()):
            shown = ", ".join(f"{m} {v:.4f}" for m, v in sorted(metrics.items())
                              if isinstance(v, float) and not m.endswith("_stderr"))
            lines.append(f"  eval {task}: {shown}")
    if res.telemetry:
        lines += telemetry_lines(res.telemetry, _baseline_telemetry(prepared, uri))
    for e in res.events:
        lines.append("  " + tidy_numbers(e.summary()))
    log = out / "lowprec.log"
    lines.append(f"  files: {out}" + (f" (other libraries' output: {log})" if log.is_file() else ""))
    if run_id:
        lines.append(f"  MLflow run {run_id} in {uri}")
        # `lowprec ui` serves a local store; a server is opened in a browser as it is
        ui = uri if uri.startswith(("http://", "https://")) else f"lowprec ui --tracking-uri {uri}"
        lines.append(f"  UI: {ui}    pictures: lowprec report {run_id} --tracking-uri {uri}")
    return "\n".join(lines)


def _baseline_telemetry(prepared, uri: str) -> tuple[str, dict[str, float]] | None:
    """(name, telemetry/* numbers) of the run's loss-gap baseline in the MLflow store at `uri`, when it names one."""
    cfg = prepared.config
    b = cfg.rollout.baseline if cfg.rollout is not None else None
    if b is None or b.mlflow_run is None:
        return None
    from lowprec.runtime.session.baseline import telemetry_of_run
    try:
        return b.mlflow_run, telemetry_of_run(uri, cfg.tracking.experiment, b.mlflow_run)
    except ConfigError:
        return None


def telemetry_lines(t: dict[str, float], baseline: tuple[str, dict[str, float]] | None = None) -> list[str]:
    """Where the time and the energy went, in a few lines (`lowprec run`'s summary)."""
    if not t:
        return []
    from lowprec.tracking.phases import Bucket, Phase
    wall = t["telemetry/wall_s"]
    wasted = [(b.value, t[f"telemetry/bucket/{b.value}_s"]) for b in Bucket if b is not Bucket.PRODUCTIVE]
    wasted = ", ".join(f"{name} {s:.1f} s" for name, s in wasted if s >= 0.05)
    lines = [f"  time: {wall:.1f} s, goodput {t['telemetry/goodput']:.0%} (productive "
             f"{t['telemetry/bucket/productive_s']:.1f} s; wasted: {wasted or 'none'})"]
    phases = [(p.value, t[f"telemetry/phase/{p.value}_s"]) for p in Phase]
    step = sum(s for _, s in phases)
    if step > 0:
        lines.append("  phases: " + ", ".join(f"{name} {s / step:.0%}" for name, s in
                                               sorted(phases, key=lambda kv: -kv[1]) if s / step >= 0.005))
    line = f"  throughput: {t.get('telemetry/tokens_per_s', 0):,.0f} tokens/s"
    if "telemetry/step_tokens_per_s" in t:
        line += f" ({t['telemetry/step_tokens_per_s']:,.0f} in the steps alone)"
    if "telemetry/mfu" in t:
        line += f", MFU {t['telemetry/mfu']:.1%}"
    lines.append(line)
    if "telemetry/energy_j" in t:
        kind = "measured" if t.get("telemetry/energy_measured") else "estimate"
        line = (f"  energy ({kind}): {t['telemetry/energy_j'] / 1e3:.2f} kJ, "
                f"{t['telemetry/energy_per_token_j'] * 1e3:.3g} mJ/token")
        if "telemetry/emissions_g" in t:
            line += f", {t['telemetry/emissions_g']:.3g} g CO2e"
        lines.append(line)
    if baseline is not None and baseline[1]:
        name, b = baseline
        parts = []
        if t.get("telemetry/tokens_per_s") and b.get("telemetry/tokens_per_s"):
            parts.append(f"time per token x{b['telemetry/tokens_per_s'] / t['telemetry/tokens_per_s']:.2f}")
        if t.get("telemetry/step_tokens_per_s") and b.get("telemetry/step_tokens_per_s"):
            parts.append(f"in the steps x{b['telemetry/step_tokens_per_s'] / t['telemetry/step_tokens_per_s']:.2f}")
        if t.get("telemetry/energy_per_token_j") and b.get("telemetry/energy_per_token_j"):
            parts.append(f"energy per token x{t['telemetry/energy_per_token_j'] / b['telemetry/energy_per_token_j']:.2f}")
        if parts:
            lines.append(f"  against {name}: " + ", ".join(parts))
    return lines
