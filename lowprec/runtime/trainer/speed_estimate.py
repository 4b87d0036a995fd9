"""What `lowprec plan` expects a rollout to gain: FLOP shares and a tokens/s ratio from a measured layer table.

A layer table holds, for one device, the milliseconds of one `Linear(d, d)` forward+backward
at a few (d, tokens) shapes, BF16 and each FP8 variant, all from one benchmark call
(`experiments/bench_linear.py`). The estimate prices every GEMM site of a plan at the table's
nearest shape (nearest in log d and log tokens; the time scaled by the site's FLOPs over the
shape's), in BF16 and in the format the rollout ends it in, and sums:

    ratio = sum(BF16 time of every site) / sum(time of every site in its final format)

It counts the linear layers' GEMMs and their casts only (attention's matmuls, norms, the
optimizer and evals run at the same speed in both runs, so the whole step's ratio lies
between 1 and this one), and one micro-batch of `batch_size x block_size` tokens a step.
A site outside the measured shapes is priced at the nearest one and the estimate says so.

Tables ship here as data with their source (the document, the run, the commit); `TABLES`
names them. `table_for(name)` picks one; `table_for_device(device)` the one measured on a
CUDA device of that name, or None: then `plan` prints that no table exists for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

__all__ = ["Execution", "LayerTable", "TABLES", "table_for", "table_for_device", "SiteGemm", "Estimate",
           "estimate", "format_estimate"]


class Execution(str, Enum):
    """How the layers run: the table's row family."""

    EAGER = "eager"
    COMPILED = "compiled"
    CUDA_GRAPHS = "cuda_graphs"


@dataclass(frozen=True)
class LayerTable:
    """Milliseconds of one Linear(d, d) fwd+bwd per (d, tokens) shape and row."""

    name: str
    device: str                                  # the CUDA device name it was measured on
    source: str                                  # where the figures are published, and how they were taken
    shapes: tuple[tuple[int, int], ...]          # (d, tokens), the order of every row's values
    rows: dict[str, tuple[float, ...]]           # row name -> ms per shape

    def ms(self, row: str, shape: tuple[int, int]) -> float:
        return self.rows[row][self.shapes.index(shape)]

    def nearest(self, d: float, tokens: int) -> tuple[tuple[int, int], bool]:
        """The measured shape nearest to (d, tokens) in log space; whether it is inside the
        measured range (else the estimate extrapolates)."""
        shape = min(self.shapes, key=lambda s: (math.log(s[0] / d)) ** 2 + (math.log(s[1] / tokens)) ** 2)
        ds, ts = [s[0] for s in self.shapes], [s[1] for s in self.shapes]
        inside = min(ds) / 1.05 <= d <= max(ds) * 1.05 and min(ts) / 1.05 <= tokens <= max(ts) * 1.05
        return shape, inside

    def row_for(self, fmt: str, execution: Execution, stats: bool) -> str | None:
        """The row that prices `fmt` run as `execution` (statistics on one step in ten when
        `stats`); the eager row where the table has no compiled one for the format."""
        if fmt == "bf16":
            return "bf16"
        named = {Execution.COMPILED: f"{fmt} compiled", Execution.CUDA_GRAPHS: f"{fmt} cuda_graphs"}
        if execution in named and named[execution] in self.rows:
            return named[execution]
        row = f"{fmt} stats 1/10" if stats else f"{fmt} stats off"
        return row if row in self.rows else None


# docs/performance.md, "The second H200 run, 2026-11-27 23:00 UTC": one bench_linear.py call,
# median of 20 after 5 warm-ups under CUDA events; raw output docs/gpu_logs/2026-11-27-session2/linear.md.
_H200_SHAPES = ((8192, 8192), (8192, 16384), (4096, 8192), (4096, 16384), (2048, 8192), (2048, 16384))
H200 = LayerTable(
    name="nvidia-h200", device="NVIDIA H200",
    source=("docs/performance.md 'The second H200 run, 2026-11-27' (experiments/bench_linear.py --d-model 8192 "
            "2048 4096 --tokens 8192 16384, main at 9737285, torch 2.11.0+cu130, Triton 3.6.0)"),
    shapes=_H200_SHAPES,
    rows={
        "bf16": (4.363, 9.869, 1.175, 2.293, 0.428, 0.597),
        "torchao tensorwise compiled": (2.889, 6.132, 1.183, 1.710, 1.178, 1.103),
        "fp8_tensorwise stats off": (3.093, 6.182, 1.287, 1.805, 1.295, 1.718),
        "fp8_tensorwise stats 1/10": (3.081, 6.318, 1.317, 1.729, 1.318, 1.478),
        "fp8_delayed stats off": (3.079, 6.080, 1.318, 1.823, 1.160, 1.445),
        "fp8_delayed stats 1/10": (3.065, 6.819, 1.183, 1.734, 1.381, 1.409),
        "fp8_rowwise stats off": (3.262, 6.923, 1.458, 1.983, 1.389, 1.606),
        "fp8_rowwise stats 1/10": (3.222, 6.525, 1.219, 1.908, 1.423, 1.570),
        "fp8_tensorwise compiled": (3.138, 6.099, 1.302, 1.925, 1.271, 1.451),
        "fp8_tensorwise cuda_graphs": (3.320, 6.081, 1.076, 1.980, 0.851, 1.124),
    })

TABLES: dict[str, LayerTable] = {H200.name: H200}


def table_for(name: str) -> LayerTable:
    try:
        return TABLES[name]
    except KeyError:
        raise ValueError(f"--speed-table: no layer table named {name!r}; tables: {', '.join(TABLES)}") from None


def table_for_device(device) -> LayerTable | None:
    """The table measured on this CUDA device's model (by name), None on any other device."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((t for t in TABLES.values() if t.device in name), None)


@dataclass(frozen=True)
class SiteGemm:
    """One GEMM site of a plan: its shape and its format at the start and at the rollout's end."""

    fqn: str
    in_features: int
    out_features: int
    start: str
    final: str

    @property
    def flops_per_token(self) -> int:
        return 6 * self.in_features * self.out_features


@dataclass(frozen=True)
class Estimate:
    table: LayerTable
    ratio: float | None                 # BF16 time over the final plan's time; None: a format has no row
    shares: dict[str, float]            # final format -> share of the GEMM FLOPs (every site)
    missing: tuple[str, ...]            # formats the table has no row for
    outside: tuple[str, ...]            # sites priced at a shape outside the measured range
    rows: tuple[str, ...]               # the table rows used
    execution: Execution


def estimate(sites: list[SiteGemm], tokens: int, table: LayerTable, *, execution: Execution = Execution.EAGER,
             stats: bool = True) -> Estimate:
    from lowprec.sites.flop_count import flops_share   # the one share rule (exact sums, one rounding)
    shares = flops_share({s.fqn: s for s in sites}, {}, {s.fqn: s.final for s in sites})
    missing, outside, used = [], [], {"bf16"}
    t_bf16 = t_final = 0.0
    for s in sites:
        shape, inside = table.nearest(math.sqrt(s.in_features * s.out_features), tokens)
        if not inside:
            outside.append(s.fqn)
        scale = (s.in_features * s.out_features * tokens) / (shape[0] * shape[0] * shape[1])
        row = table.row_for(s.final, execution, stats)
        t_bf16 += table.ms("bf16", shape) * scale
        if row is None:
            missing.append(s.final)
            continue
        used.add(row)
        t_final += table.ms(row, shape) * scale
    ratio = None if missing or not t_final else t_bf16 / t_final
    return Estimate(table, ratio, shares, tuple(sorted(set(missing))), tuple(outside), tuple(sorted(used)), execution)


def format_estimate(est: Estimate | None, device_label: str, stage_shares: list[tuple[str, str, float]]) -> str:
    """The plan's lines: FLOP shares (per stage and at the rollout's end) and the expected ratio."""
    lines = ["", "GEMM FLOP shares (6 x in x out per token, every linear site incl. those kept in BF16):"]
    for name, fmt, share in stage_shares:
        lines.append(f"  stage {name}: {share:.1%} of the FLOPs -> {fmt}")
    if est is not None:
        ends = ", ".join(f"{f} {v:.1%}" for f, v in sorted(est.shares.items(), key=lambda kv: -kv[1]))
        lines.append(f"  at the rollout's end: {ends}")
    if est is None:
        lines.append(f"expected tokens/s (rollout vs BF16): no layer table for this device ({device_label}); "
                     f"tables: {', '.join(f'{t.name} ({t.device})' for t in TABLES.values())}; "
                     "`lowprec plan CONFIG --speed-table NAME` estimates for one of them")
        return "\n".join(lines)
    if est.ratio is None:
        lines.append(f"expected tokens/s (rollout vs BF16): table {est.table.name} has no row for "
                     f"{', '.join(est.missing)}: no estimate")
    else:
        lines.append(f"expected tokens/s (rollout vs BF16): {est.ratio:.2f}x in the linear layers' GEMMs "
                     f"({est.execution.value}; the whole step's ratio lies between 1 and this: attention, norms and "
                     "the optimizer run alike in both)")
    lines.append(f"  layer table {est.table.name}: {est.table.source}; rows: {', '.join(est.rows)}")
    if est.outside:
        named = ", ".join(est.outside[:3]) + (f" +{len(est.outside) - 3} more" if len(est.outside) > 3 else "")
        lines.append(f"  {len(est.outside)} site(s) ({named}) lie outside the measured shapes (d {min(s[0] for s in est.table.shapes)}-"
                     f"{max(s[0] for s in est.table.shapes)}, {min(s[1] for s in est.table.shapes)}-"
                     f"{max(s[1] for s in est.table.shapes)} tokens): priced at the nearest, an extrapolation")
    return "\n".join(lines)


def _compiled(model, fqn: str) -> bool:
    """Whether the site runs inside a module compiled in place (`nn.Module.compile`)."""
    parts = fqn.split(".")
    return any(getattr(model.get_submodule(".".join(parts[:i])), "_compiled_call_impl", None) is not None
               for i in range(len(parts) + 1))


def plan_lines(prepared, table_name: str | None) -> str:
    """The `lowprec plan` lines for a prepared run: every linear site's FLOPs (the switchable
    sites and the ones kept in BF16), its format after every stage, priced by the table named
    (or the model's device's own), with one micro-batch of `batch_size / microbatches x block_size` tokens."""
    from lowprec.runtime.trainer.device_note import model_device
    cfg, state, model = prepared.config, prepared.state, prepared.model
    final = {fqn: s.format.name for fqn, s in state.sites.items()}
    stage_shares = []
    total = (sum(s.flops_per_token for s in state.sites.values())
             + sum(6 * m.in_features * m.out_features for f in state.kept_high_precision
                   if hasattr(m := model.get_submodule(f), "in_features"))) or 1
    for st in (prepared.controller.stages if prepared.controller is not None else ()):
        final.update(dict.fromkeys(st.sites, st.format))
        stage_shares.append((st.name, st.format, sum(state.sites[f].flops_per_token for f in st.sites) / total))
    sites = [SiteGemm(f, s.module.in_features, s.module.out_features, s.format.name, final[f])
             for f, s in state.sites.items()]
    sites += [SiteGemm(f, m.in_features, m.out_features, "bf16", "bf16") for f in state.kept_high_precision
              if hasattr(m := model.get_submodule(f), "in_features")]
    device = model_device(model)
    table = table_for(table_name) if table_name else table_for_device(device)
    if table is None:
        return format_estimate(None, str(device), stage_shares)
    block = cfg.data.block_size or getattr(model, "block_size", None) or 1
    tokens = cfg.train.batch_size // cfg.train.microbatches * block
    execution = Execution.COMPILED if any(_compiled(model, s.fqn) for s in sites if s.final != "bf16") \
        else Execution.EAGER
    stats = prepared.controller is not None
    est = estimate(sites, tokens, table, execution=execution, stats=stats)
    others = []
    for other in Execution:   # the same plan run the other ways the table prices
        if other is not execution and (alt := estimate(sites, tokens, table, execution=other, stats=stats)).ratio:
            others.append(f"{other.value} {alt.ratio:.2f}x")
    return (format_estimate(est, str(device), stage_shares) + f"\n  tokens a step (one micro-batch): {tokens:,}"
            + (f"\n  run otherwise: {', '.join(others)} (the table's rows for each; eager rows where it has none)"
               if others else ""))
