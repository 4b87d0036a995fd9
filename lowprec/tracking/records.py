"""What the tracker's inputs become in MLflow: names, params, metric rows, the precision map.

Pure functions and one small bookkeeping class, no I/O and no MLflow import, so that the
naming rules can be read (and tested) in one place:

* names: MLflow accepts letters, digits, `_ - . / : space`, no `..`/`.`/empty path parts,
  250 characters (`metric_key`; a longer name keeps a hash of the whole so it stays unique);
* config: nested keys joined by dots, list indices as parts (`precision.rules.0.format`, since
  MLflow refuses `[0]`), values as YAML would print them, cut to 6,000 characters
  (`flatten_config`);
* signals: `signal/<site>/<role>/<stat>` from any of the shapes the monitor and
  `PrecisionState.stats()` produce, QuantStats read from the device in one transfer;
* evals: `<prefix>/<task>/<metric>` (prefix `eval`, or `eval_hp` for the same weights in high
  precision), lm-eval's `acc,none` written `acc`; per-example scores in one JSON artifact per
  call, `evals/<prefix>_step<NNNNNN>.json`;
* the precision map over time: initial, changes, final, and the FLOP share per format,
  with a format that disappeared logged as 0 rather than left at its last value;
* text for people (run summaries, the MLflow note, report notes): numbers at `NUMBER_DIGITS`
  significant digits (`number`), and float noise that a reason carries over from `str(float)`
  (`0.9600000000000004`) cut the same way (`tidy_numbers`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from typing import Any, Mapping

from lowprec.base.enums import StrEnum

__all__ = ["SIGNAL_STATS", "BASELINE_LOSS", "LR_SENSITIVITY", "MAX_KEY", "MAX_PARAM_VALUE", "MAX_TAG_VALUE", "now_ms",
           "metric_key", "fit_value", "flatten_config", "signal_metrics", "eval_metrics", "eval_metric_name",
           "eval_samples", "eval_artifact_name", "EVAL_PREFIX", "merge", "chunk",
           "PrecisionMapLog", "RunStatus", "NUMBER_DIGITS", "number", "tidy_numbers"]

SIGNAL_STATS = ("amax", "saturated_frac", "underflow_frac", "underflow_energy_frac", "rel_mse", "sqnr_db",
                "nonfinite")
BASELINE_LOSS = "train/baseline_loss"
LR_SENSITIVITY = "train/lr_sensitivity"   # the LR probe's (L_x2 - L_x0.5) / |L0| (lowprec.runtime.session.lrprobe)
MAX_KEY, MAX_PARAM_VALUE, MAX_TAG_VALUE = 250, 6000, 8000


class RunStatus(StrEnum):
    """How a run ended: MLflow's terminal statuses, as the tracker's `terminate` record keeps them."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"


def now_ms() -> int:
    return int(time.time() * 1000)


def metric_key(name: str) -> str:
    """An MLflow-valid metric/param name: allowed characters only, no empty or dot path parts."""
    name = re.sub(r"[^/\w.\- :]", "_", str(name))
    key = "/".join(p for p in name.split("/") if p not in ("", ".", "..")) or "_"
    if len(key) <= MAX_KEY:
        return key
    return key[:MAX_KEY - 9] + "~" + hashlib.sha1(key.encode()).hexdigest()[:8]


def fit_value(v: str, limit: int, where: str) -> str:
    """`v`, or its start with a note saying how long it was and where the whole is."""
    if len(v) <= limit:
        return v
    note = f" ...[{len(v)} chars, truncated; full value in {where}]"
    return v[:limit - len(note)] + note


def flatten_config(cfg: Mapping, prefix: str = "") -> dict[str, str]:
    """`{"precision": {"rules": [{"format": "nvfp4"}]}}` -> `{"precision.rules.0.format": "nvfp4"}`."""
    out: dict[str, str] = {}

    def walk(v: Any, key: str) -> None:
        if isinstance(v, Mapping) and v:
            for k, x in v.items():
                walk(x, f"{key}.{k}" if key else str(k))
        elif isinstance(v, (list, tuple)) and v:
            for i, x in enumerate(v):
                walk(x, f"{key}.{i}" if key else str(i))
        else:
            text = v if isinstance(v, str) else json.dumps(v, default=str)
            out[metric_key(key)] = fit_value(text, MAX_PARAM_VALUE, "config.yaml")

    walk(dict(cfg), prefix)
    return out


def _quantstats_dicts(sites: Mapping[str, Any]) -> dict[tuple[str, str], dict]:
    """All QuantStats among the sites' roles, read to the host in one transfer."""
    found = [(site, role, q) for site, per in sites.items() if isinstance(per, Mapping)
             for role, q in per.items() if hasattr(q, "packed") and hasattr(q, "to_dict")]
    if not found:
        return {}
    import torch
    rows = torch.stack([q.packed.detach().double() for _, _, q in found]).cpu()
    return {(site, role): type(q)(row).to_dict() for (site, role, q), row in zip(found, rows)}


# What the monitor never measures, left out rather than logged as zeros: a site's output is
# only checked for non-finite values (lowprec.policy.monitor's output hook), never quantized.
UNMEASURED = {"output": frozenset({"amax", "saturated_frac", "underflow_frac", "underflow_energy_frac", "rel_mse",
                                   "sqnr_db"})}


def signal_metrics(signals: Any, stats: tuple[str, ...] = SIGNAL_STATS) -> dict[str, float]:
    """`signal/<site>/<role>/<stat>` -> value, and from the monitor's `Signals` each MoE layer's
    `router/<experts module>/collapse` (lowprec.policy.router_signals). Takes
    `PrecisionState.stats()` ({site: {role: QuantStats | dict}}), the monitor's `Signals` (its
    `.sites`), or {site: SiteSignals | {"role/stat": value}}. A +inf SQNR (no quantization error at all) is left out, and so is
    what is never measured (`UNMEASURED`: of a site's output, only `nonfinite`)."""
    sites = getattr(signals, "sites", signals)
    host = _quantstats_dicts(sites)
    out = {}
    for site, per in sites.items():
        if hasattr(per, "flat"):                          # lowprec.policy.monitor.SiteSignals
            flat = {k: float(v) for k, v in per.flat().items()}
        else:
            flat = {}
            for key, v in per.items():
                v = host.get((site, key), v)
                if isinstance(v, Mapping):
                    flat.update({f"{key}/{s}": float(x) for s, x in v.items() if isinstance(x, (int, float))})
                elif v is not None:
                    flat[str(key)] = float(v)
        for key, v in flat.items():
            role, _, stat = key.rpartition("/")
            if role.rpartition("/")[2] in UNMEASURED and stat in UNMEASURED[role.rpartition("/")[2]]:
                continue
            if stat in stats and not (stat == "sqnr_db" and math.isinf(v)):
                out[f"signal/{site}/{key}"] = v
    for layer, r in getattr(signals, "routers", {}).items():   # a check's routing, every rank's tokens
        out[f"router/{layer}/collapse"] = r.collapse
    return out


def eval_metric_name(metric: str) -> str:
    """lm-eval's `acc,none` -> `acc`, `acc,flex` -> `acc_flex` (the name under `<prefix>/<task>/`)."""
    return str(metric).replace(",none", "").replace(",", "_")


def eval_metrics(results: Mapping[str, Any], prefix: str = "eval") -> dict[str, float]:
    """{task: {metric: value}} (lm-eval's `acc,none`, `acc_stderr,none` too) -> `<prefix>/<task>/<metric>`."""
    out = {}
    for task, v in results.items():
        if isinstance(v, Mapping):
            for m, x in v.items():
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    out[f"{prefix}/{task}/{eval_metric_name(m)}"] = float(x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}/{task}"] = float(v)
    return out


def eval_samples(samples: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """{task: {metric: {example key: score}}} with metric names as in `eval_metrics`, keys as
    strings and scores as floats (NaN/Inf kept: JSON as Python writes it reads them back)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task, per in samples.items():
        if not isinstance(per, Mapping):
            raise TypeError(f"samples[{task!r}] must be {{metric: {{example key: score}}}}, got {type(per).__name__}")
        for m, scores in per.items():
            if not isinstance(scores, Mapping):
                raise TypeError(f"samples[{task!r}][{m!r}] must be {{example key: score}}, got {type(scores).__name__}")
            out.setdefault(str(task), {})[eval_metric_name(m)] = {str(k): float(v) for k, v in scores.items()}
    return out


def eval_artifact_name(prefix: str, step: int) -> str:
    """Where `Tracker.log_eval` stores one call's results and per-example scores in the run."""
    return f"evals/{prefix}_step{int(step):06d}.json"


EVAL_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-.]*")


def merge(into: dict, new: Mapping) -> dict:
    """Deep-merge `new` into `into` (sections logged later add to earlier ones)."""
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


def chunk(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


class PrecisionMapLog:
    """The precision map over time, as saved in `precision_map.json`:
    {initial_step, initial, changes: [{step, formats}], step, final, flops_share, flops_formats}.
    A map logged at a step no later than a recorded change (a resume from an older checkpoint,
    steps redone after a rewind) drops the changes from that step on: they belonged to steps
    that were abandoned, and the redone steps record their own."""

    def __init__(self, saved: dict | None = None):
        self.data = dict(saved or {})
        self.formats_seen: set[str] = set(self.data.get("flops_formats", []))

    def update(self, step: int, formats: dict[str, str], share: dict[str, float]) -> tuple[list, dict | None]:
        """FLOP-share metric rows [key, value, step] and, when the map changed, the tags to set."""
        self.formats_seen |= set(share)
        rows = [[f"precision/flops_share/{f}", share.get(f, 0.0), step] for f in sorted(self.formats_seen)]
        d = self.data
        if not d:
            d.update(initial_step=step, initial=dict(formats), changes=[])
        kept = [c for c in d["changes"] if c["step"] < step]
        abandoned, d["changes"] = len(kept) < len(d["changes"]), kept
        before = dict(d["initial"])
        for c in kept:
            before.update(c["formats"])
        changed = {s: f for s, f in formats.items() if before.get(s) != f}
        if not changed and not abandoned and "final" in d:
            return rows, None
        if changed:
            d["changes"].append({"step": step, "formats": changed})
        d.update(step=step, final=dict(formats), flops_share=dict(share), flops_formats=sorted(self.formats_seen))
        return rows, self.tags()

    def tags(self) -> dict[str, str]:
        """The run tags of the latest map (`lowprec.precision_map`, `lowprec.flops_share`); {} before one."""
        if "final" not in self.data:
            return {}
        by_fmt: dict[str, list[str]] = {}
        for s, f in self.data["final"].items():
            by_fmt.setdefault(f, []).append(s)
        summary = " | ".join(f"{f}({len(s)}): {', '.join(s)}" for f, s in sorted(by_fmt.items()))
        share = self.data.get("flops_share", {})
        shares = ", ".join(f"{f} {v:.1%}" for f, v in sorted(share.items(), key=lambda kv: -kv[1]))
        return {"lowprec.precision_map": fit_value(summary, MAX_TAG_VALUE, "precision_map.json"),
                "lowprec.flops_share": shares}


NUMBER_DIGITS = 4   # significant digits of a number in text for people
# a decimal with more than 6 digits after the point, as `str(float)` writes a computed value
_LONG_DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d{7,}(?:e[+-]?\d+)?(?![\w.])")


def number(v: Any) -> str:
    """`v` for a person: a float at `NUMBER_DIGITS` significant digits (`0.96`, `3.1e-05`), a
    list or tuple of them element by element, anything else as `str` writes it."""
    if isinstance(v, bool) or not isinstance(v, (float, list, tuple)):
        return str(v)
    if isinstance(v, float):
        return f"{v:.{NUMBER_DIGITS}g}"
    return "[" + ", ".join(number(x) for x in v) + "]"


def tidy_numbers(text: str) -> str:
    """`text` with every long decimal (`0.9600000000000004`, `3.520367988700015`) written at
    `NUMBER_DIGITS` significant digits; integers, versions and short decimals stay as they are."""
    return _LONG_DECIMAL.sub(lambda m: number(float(m.group())), text)
