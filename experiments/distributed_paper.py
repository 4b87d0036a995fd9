"""Collectives per rank and step at scale, on paper: Llama 8B and 70B, FSDP x TP 8.

    python -m experiments.distributed_paper            # the table of docs/distributed.md

From the model's dimensions and the count model of the amax all-reduces
(experiments/amax_count.py, which the torchrun tests hold the code to): a block's q, k, v,
gate and up are column-parallel on sequence-sharded inputs (q, k, v read one, gate and up
another), o and down row-parallel; `local` (the default) reduces each SP input's amax once
over TP, `group` also every activation and gradient over the data-parallel group and every
TP-split operand over TP; FP8 all-gather sends 1 byte per weight element (BF16: 2) and takes
the weights' amaxes in 1 all-reduce per step; the statistics of a check step are 1
all-gather for all sites. Three recipes:

* bf16: BF16 weights gathered, FP32 gradient reduce-scatter, BF16 TP/SP collectives;
* lowprec: tensor-wise FP8 with FP8 weight all-gather, `local` or `group` amax scope, FP8
  sequence-parallel input gathers (`FP8SequenceColwiseParallel`; the input's amax is
  all-reduced over TP once for the sites reading it, counted with the amax all-reduces);
* torchao: float8 tensor-wise with `enable_fsdp_float8_all_gather` and
  `precompute_float8_dynamic_scale_for_fsdp` (1 all-reduce per step), Float8ColwiseParallel
  (the SP input is cast before its all-gather: FP8 bytes, one TP amax all-reduce each).

Per rank and step (one global step, no gradient accumulation): ring collectives move
(n-1)/n of the gathered/reduced tensor per rank; FSDP2 gathers each weight twice (forward,
and again in backward: reshard_after_forward) and reduce-scatters its gradient once. Time
= bytes / bandwidth + count x latency, at 400 GB/s (NVLink) and 50 GB/s (inter-node), the
latency an assumption of this script (LATENCY_US), not a measurement.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from experiments.amax_count import SiteLayout, Split, amax_all_reduces, torchao_amax_all_reduces

__all__ = ["Llama", "MODELS", "rows", "amax_rows", "amax_table", "main"]

LATENCY_US = {400: 10.0, 50: 25.0}   # assumed per-collective latency at each bandwidth (µs)
SEQ_PER_RANK = 8192                   # tokens per data-parallel rank per step


@dataclass(frozen=True)
class Llama:
    name: str
    d: int
    layers: int
    kv: int          # key/value width (kv heads x head dim)
    ffn: int
    vocab: int = 128256

    @property
    def site_elems(self) -> list[int]:
        """Weight elements of the 7 linear sites of one block: q, k, v, o, gate, up, down."""
        d, kv, f = self.d, self.kv, self.ffn
        return [d * d, d * kv, d * kv, d * d, d * f, d * f, f * d]


MODELS = (Llama("Llama 8B", 4096, 32, 1024, 14336), Llama("Llama 70B", 8192, 80, 1024, 28672))
GPUS = (64, 512)


def block_sites(m: Llama) -> list[SiteLayout]:
    """Every FP8 site of the model under TP with SP (torchtitan's Llama plan): per block q, k,
    v (SP, one input), o (row), gate, up (SP, one input), down (row)."""
    out = []
    for i in range(m.layers):
        attn, ffn = SiteLayout(Split.SP, f"{i}.attention_norm"), SiteLayout(Split.SP, f"{i}.ffn_norm")
        out += [attn, attn, attn, SiteLayout(Split.ROW), ffn, ffn, SiteLayout(Split.ROW)]
    return out


def amax_rows(m: Llama) -> dict[str, int]:
    """Amax all-reduces per rank and step (FSDP x TP 8 with SP, FP8 all-gather; any DP degree)."""
    sites = block_sites(m)
    return {scope: amax_all_reduces(sites, scope=scope, dp=True, fp8_all_gather=True) for scope in ("local", "group")} | {
        "torchao": torchao_amax_all_reduces(sites, fp8_all_gather=True)}


def _ring(n: int) -> float:
    return (n - 1) / n


def rows(m: Llama, gpus: int, tp: int = 8) -> list[tuple[str, str, int, float]]:
    """(collective, recipe, count, bytes) per rank per step."""
    dp = gpus // tp
    w = sum(m.site_elems) * m.layers / tp                  # this TP rank's block weights
    other = 2 * m.vocab * m.d / tp                         # embeddings + head (BF16 in every recipe)
    act = SEQ_PER_RANK * m.d                               # one SP activation, whole sequence
    sites, L = 7 * m.layers, m.layers
    out = []
    for recipe, w_bytes in (("bf16", 2), ("lowprec", 1), ("torchao", 1)):
        gather = 2 * _ring(dp) * (w * w_bytes + other * 2)
        out.append(("FSDP weight all-gather", recipe, 2 * (L + 1), gather))
        out.append(("FSDP grad reduce-scatter (FP32)", recipe, L + 1, _ring(dp) * (w + other) * 4))
        sp_fwd_bytes = 2 if recipe == "bf16" else 1   # FP8 SP input gathers (both FP8 recipes)
        tp_bytes = _ring(tp) * act * (2 * sp_fwd_bytes + 2 * 2 + 4 * 2)   # fwd 2 AG + 2 RS, bwd 2 AG + 2 RS
        out.append(("TP/SP all-gather + reduce-scatter", recipe, 8 * L, tp_bytes))
    # amaxes (experiments/amax_count.py): 4 bytes each, the FP8-gathered weights' all-reduce
    # carrying one amax per site
    amax = amax_rows(m)
    out.append(("amax all-reduce, local scope (default)", "lowprec", amax["local"], (amax["local"] - 1 + sites) * 4))
    out.append(("amax all-reduce, group scope", "lowprec", amax["group"], (amax["group"] - 1 + sites) * 4))
    out.append(("amax all-reduce", "torchao", amax["torchao"], (amax["torchao"] - 1 + sites) * 4))
    out.append(("statistics all-gather (check step)", "lowprec", 1, gpus * sites * 4 * 8 * 8))
    return out


def _time_ms(count: int, nbytes: float, bw_gb_s: int) -> float:
    return nbytes / (bw_gb_s * 1e9) * 1e3 + count * LATENCY_US[bw_gb_s] * 1e-3


def amax_table() -> str:
    """lowprec's amax all-reduces per rank and step against torchao's, in both scopes."""
    lines = ["| model | GPUs (FSDP x TP) | lowprec `local` (default) | lowprec `group` | torchao | default / torchao |",
             "|---|---|---:|---:|---:|---:|"]
    for m in MODELS:
        a = amax_rows(m)
        for gpus in GPUS:
            lines.append(f"| {m.name} | {gpus} ({gpus // 8} x 8) | {a['local']} | {a['group']} | {a['torchao']} | "
                         f"{a['local'] / a['torchao']:.2f}x |")
    return "\n".join(lines)


def table() -> str:
    lines = ["| model | GPUs (FSDP x TP) | collective | recipe | count | MB per rank | ms at 400 GB/s | ms at 50 GB/s |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for m in MODELS:
        for gpus in GPUS:
            for name, recipe, count, nbytes in rows(m, gpus):
                lines.append(f"| {m.name} | {gpus} ({gpus // 8} x 8) | {name} | {recipe} | {count} | "
                             f"{nbytes / 1e6:,.1f} | {_time_ms(count, nbytes, 400):,.2f} | "
                             f"{_time_ms(count, nbytes, 50):,.2f} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    out = amax_table() + "\n\n" + table()
    try:
        print(out)
    except BrokenPipeError:   # `| head`
        pass
    return out


if __name__ == "__main__":
    main()
