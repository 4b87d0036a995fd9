"""Measure what each precision site costs in accuracy when it alone runs in a low-precision format.

For every (site, format) pair: every other site stays in BF16, the held batches run
forward and backward once with only that site quantized, and three things are read:

* the SQNR of each quantized operand (input, weight, grad_output), from the layer's own
  quantizer statistics summed over the held batches;
* the relative change of the mean loss against the all-BF16 reference on the same batches;
* the cosine between the model's whole gradient (every trainable parameter) and the
  all-BF16 gradient on the same batches, and the same cosine per parameter tensor,
  averaged with the tensors' sizes as weights (`grad_cosine_tensors`).

`sensitivity = forward noise + max(loss change, 0) + (1 - grad_cosine_tensors)`, all
relative and dimensionless, zero for BF16 itself:

* **forward noise**: the noise-to-signal energy ratio of the GEMM's two forward operands,
  `10^(-SQNR_input/10) + 10^(-SQNR_weight/10)`, the relative error energy the site puts into
  its output (and, through the input, into its weight gradient) at every step. It is the term
  that predicts what training with the site quantized costs: on the reference GPT, each site
  alone in plain FP4 from step 0 costs -0.4% to +26% of loss after 300 steps, and the input's
  noise ranks those costs with a rank correlation of +0.79 (profile at step 0) and +0.90 (after
  60 steps), where the one-step loss change and gradient cosine rank them at +0.0 to +0.6
  (docs/profile.md). The output projections, whose inputs are the attention output and the
  GELU output, are the costly ones.
* **loss change**: what one site does to the loss the optimizer sees, on these weights.
* **per-tensor gradient cosine**: what it does to the direction the optimizer steps in. It is
  the one that counts for Adam, which normalises every element's step: a site whose FP4
  gradients lose a fifth of their energy turns its own weight's gradient to 0.89 in cosine
  while the whole gradient, dominated by larger tensors, still reads 0.9999.

Cost: `batches * (1 + pairs)` forward+backward passes per rank (one reference, then one
per pair), nothing stored but the reference gradient. `sample` profiles a few sites of
each role (`blocks.*.mlp.fc`) in evenly spaced blocks and gives every other site of that
role the numbers of the nearest profiled one (marked as estimated). Under
`torch.distributed` the pairs are split over the ranks and gathered, so every rank ends
with the same profile; ranks whose weights or batches differ are refused.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lowprec.numerics.formats import Format, get_format
from lowprec.numerics.quantize import QuantStats
from lowprec.runtime.engines.engine import loss_of
from lowprec.state.ranks import from_every_rank

__all__ = ["SiteCost", "Profile", "profile_sites", "site_role", "sample_sites", "bits_saved_share"]

_OPERANDS = ("input", "weight", "grad_output")
_FORWARD_OPERANDS = ("input", "weight")
_AMAX = QuantStats.FIELDS.index("amax")
_BLOCK_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _noise_ratio(sqnr_db: float) -> float:
    """Noise energy over signal energy for an SQNR in dB (inf dB: no noise; NaN stays NaN)."""
    return 10.0 ** (-sqnr_db / 10.0)


def bits_saved_share(fmt: Format) -> float:
    """The share of a BF16 GEMM's cost a format saves: 1 - bits/16 (FP8 0.5, FP4 0.75),
    the ratio of dense tensor-core peaks on Hopper and Blackwell."""
    return max(0.0, 1.0 - fmt.bits / 16)


@dataclass(frozen=True)
class SiteCost:
    """One site in one format, every other site in BF16, on the held batches."""

    fqn: str
    format: str
    flop_share: float                  # of the switchable sites' GEMM FLOPs
    loss_delta: float                  # (loss - reference) / reference, mean loss over the batches
    grad_cosine: float                 # cos(gradient, BF16 gradient), all trainable parameters
    grad_cosine_tensors: float = 1.0   # the same per parameter tensor, mean weighted by size
    sqnr_db: dict[str, float] = field(default_factory=dict)   # operand -> SQNR (dB)
    underflow_energy: float = 0.0      # the largest share of an operand's energy flushed to zero
    estimated_from: str | None = None  # sampled profiles: the profiled site whose numbers these are

    @property
    def forward_noise(self) -> float:
        """Noise-to-signal energy ratio of the input plus that of the weight (0 where not measured)."""
        return sum(_noise_ratio(self.sqnr_db[op]) for op in _FORWARD_OPERANDS if op in self.sqnr_db)

    @property
    def sensitivity(self) -> float:
        terms = (self.forward_noise, max(self.loss_delta, 0.0), 1.0 - self.grad_cosine_tensors)
        if not all(math.isfinite(v) for v in (*terms, self.grad_cosine)):
            return math.inf
        return sum(terms)

    @property
    def flops_saved(self) -> float:
        """The site's share of GEMM FLOPs times the share of their cost this format saves."""
        return self.flop_share * bits_saved_share(get_format(self.format))

    @property
    def per_flop_saved(self) -> float:
        """Sensitivity per FLOP saved: the order stages are written in (least first)."""
        saved = self.flops_saved
        return self.sensitivity / saved if saved > 0 else math.inf

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(forward_noise=self.forward_noise, sensitivity=self.sensitivity, per_flop_saved=self.per_flop_saved)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "SiteCost":
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in keys})


@dataclass
class Profile:
    """Every measured (site, format) pair, and what the measurement cost."""

    entries: list[SiteCost]
    reference_loss: float
    batches: int
    tokens_per_batch: int
    passes_per_rank: int
    world: int
    seconds: float
    sampled: int | None = None         # sites actually profiled when sampling, else None

    def entry(self, fqn: str, fmt: str) -> SiteCost | None:
        return next((e for e in self.entries if e.fqn == fqn and e.format == fmt), None)

    def ranked(self) -> list[SiteCost]:
        """Most sensitive per FLOP saved first (the table's order)."""
        return sorted(self.entries, key=lambda e: (-e.per_flop_saved, -e.sensitivity, e.fqn, e.format))

    def formats(self) -> list[str]:
        return sorted({e.format for e in self.entries}, key=lambda f: get_format(f).bits)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "entries"}
        d["entries"] = [e.to_dict() for e in self.entries]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Profile":
        rest = {k: v for k, v in d.items() if k != "entries"}
        return cls(entries=[SiteCost.from_dict(e) for e in d["entries"]], **rest)


def site_role(fqn: str) -> str:
    """The site's name with its block indices starred: `blocks.3.mlp.fc` -> `blocks.*.mlp.fc`."""
    return _BLOCK_INDEX.sub("*", fqn)


def _block(fqn: str) -> int:
    m = _BLOCK_INDEX.search(fqn)
    return int(m.group()) if m else 0


def sample_sites(fqns: Sequence[str], n: int) -> dict[str, str]:
    """Which profiled site stands for each site when only `n` are profiled: {site: profiled site}.

    The sites are grouped by role; every role gets at least one profiled site and the rest
    of `n` go to roles in proportion to their size; within a role, the profiled sites are
    evenly spaced over its blocks (first and last included) and every other site takes the
    nearest one. Deterministic, so every rank picks the same."""
    roles: dict[str, list[str]] = {}
    for f in fqns:
        roles.setdefault(site_role(f), []).append(f)
    if n < len(roles):
        raise ValueError(f"--sample {n} is fewer than the {len(roles)} roles of sites (e.g. "
                         f"{', '.join(list(roles)[:3])}); every role needs one profiled site: give "
                         f"--sample {len(roles)} or more")
    quota = {r: 1 for r in roles}
    spare = n - len(roles)
    while spare > 0:   # the next site goes to the role with the most sites per profiled site
        r = max((r for r in roles if quota[r] < len(roles[r])), key=lambda r: len(roles[r]) / quota[r], default=None)
        if r is None:
            break
        quota[r] += 1
        spare -= 1
    stand_in: dict[str, str] = {}
    for r, members in roles.items():
        members = sorted(members, key=_block)
        k = quota[r]
        picks = [members[round(i * (len(members) - 1) / (k - 1))] for i in range(k)] if k > 1 else [members[len(members) // 2]]
        for f in members:
            stand_in[f] = min(picks, key=lambda p: (abs(_block(p) - _block(f)), _block(p)))
    return stand_in


def _fingerprint(params: Iterable[torch.Tensor], batches) -> torch.Tensor:
    vals = [p.detach().double().sum() for p in params] + [x.double().sum() + y.double().sum() for x, y in batches]
    return torch.stack(vals).cpu() if vals else torch.zeros(1, dtype=torch.float64)


def _check_same_on_ranks(fp: torch.Tensor, group) -> None:
    got = from_every_rank(fp.tolist(), group)
    bad = [r for r, g in enumerate(got) if g != got[0]]
    if bad:
        raise ValueError(f"ranks {bad} hold other weights or held batches than rank 0; a distributed profile "
                         f"needs the same model and batches on every rank (load the same checkpoint, or "
                         f"broadcast the weights, and draw the batches with the same seed)")


class _Measurer:
    """Forward and backward of the held batches with the current formats; the reference kept."""

    def __init__(self, model: nn.Module, state, batches, seed: int):
        self.model, self.state, self.batches, self.seed = model, state, batches, seed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.scaling = state.scaling_state()   # every pair starts from the same scales and draws
        self.ref_loss, self.ref_grads = self._run()
        self.ref_norms = [float(g.double().pow(2).sum().sqrt()) for g in self.ref_grads]
        self.ref_norm = math.sqrt(sum(n * n for n in self.ref_norms))

    def _run(self, after_batch: Callable[[], None] | None = None):
        self.model.zero_grad(set_to_none=True)
        self.state.load_scaling_state(self.scaling)
        devices = [p.device for p in self.params if p.device.type == "cuda"][:1]
        total = 0.0
        with torch.random.fork_rng(devices=devices):   # dropout draws the same masks for every pair
            torch.manual_seed(self.seed)
            for x, y in self.batches:
                loss = loss_of(self.model(x, y))
                (loss / len(self.batches)).backward()
                total += float(loss.detach())
                if after_batch is not None:
                    after_batch()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.model.zero_grad(set_to_none=True)
        return total / len(self.batches), grads

    def measure(self, fqn: str, fmt: Format, flop_share: float) -> SiteCost:
        site = self.state.site(fqn)
        totals: dict[str, torch.Tensor] = {}

        def keep_stats():   # each batch's operand statistics, summed over the batches
            for role in _OPERANDS:
                st = site.module.stats.get(role)
                if st is not None:
                    prev = totals.get(role)
                    totals[role] = st.packed.clone() if prev is None else _merge(prev, st.packed)
        bf16 = get_format("bf16")
        self.state.set_format(fqn, fmt)
        try:
            loss, grads = self._run(keep_stats)
        finally:
            self.state.set_format(fqn, bf16)
        dots = [float((g.double() * r.double()).sum()) for g, r in zip(grads, self.ref_grads)]
        norms = [float(g.double().pow(2).sum().sqrt()) for g in grads]
        cosine = _cosine(sum(dots), math.sqrt(sum(n * n for n in norms)), self.ref_norm)
        sizes = [g.numel() for g in grads]
        per_tensor = sum(n * _cosine(d, a, b) for n, d, a, b in zip(sizes, dots, norms, self.ref_norms)) / max(sum(sizes), 1)
        stats = {role: QuantStats(p).to_dict() for role, p in totals.items()}
        return SiteCost(fqn=fqn, format=fmt.name, flop_share=flop_share,
                        loss_delta=(loss - self.ref_loss) / abs(self.ref_loss) if self.ref_loss else loss,
                        grad_cosine=cosine if math.isfinite(cosine) else math.nan,
                        grad_cosine_tensors=per_tensor if math.isfinite(per_tensor) else math.nan,
                        sqnr_db={r: v["sqnr_db"] for r, v in stats.items()},
                        underflow_energy=max((v["underflow_energy_frac"] for v in stats.values()), default=0.0))


def _cosine(dot: float, a: float, b: float) -> float:
    """dot / (a b); two zero vectors agree (1), a zero against a non-zero one does not (0)."""
    if a > 0 and b > 0:
        return dot / (a * b)
    return 1.0 if a == b else 0.0


def _merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a + b
    out[_AMAX] = torch.maximum(a[_AMAX], b[_AMAX])
    return out


def profile_sites(model: nn.Module, state, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                  formats: Mapping[str, Sequence[Format | str]], sample: int | None = None, group=None,
                  seed: int = 0, progress: Callable[[int, int, SiteCost], None] | None = None) -> Profile:
    """Profile every site of `state` in each of its `formats` ({fqn: formats}; see the module doc).

    batches: the held batches, the same on every rank; group: the process group to split the
        pairs over (default: the world when torch.distributed is initialised); seed: the RNG
        seed of every pass (dropout). The sites' formats, statistics switches and scaling
        state (stochastic-rounding generators, amax histories) are restored on return.
    """
    t0 = time.perf_counter()
    if not batches:
        raise ValueError("profiling needs at least one held batch")
    unknown = sorted(set(formats) - set(state.sites))
    if unknown:
        raise ValueError(f"formats given for {unknown[:3]}, which are not precision sites")
    fmts = {f: [get_format(x) for x in formats.get(f, ()) if not get_format(x).is_high_precision] for f in state.sites}
    total_flops = sum(s.flops_per_token for s in state.sites.values()) or 1
    share = {f: s.flops_per_token / total_flops for f, s in state.sites.items()}
    stand_in = sample_sites(list(state.sites), sample) if sample is not None else {f: f for f in state.sites}
    profiled = [f for f in state.sites if stand_in[f] == f]
    pairs = [(f, fmt) for f in profiled for fmt in fmts[f]]
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    was = {f: s.format for f, s in state.sites.items()}
    scaling = state.scaling_state()   # generators and amax histories, put back on return
    params = [p for p in model.parameters() if p.requires_grad]
    if distributed and world > 1:
        _check_same_on_ranks(_fingerprint(params, batches), group)
    my_pairs = pairs[rank::world]
    # the profiled site's operand statistics (bf16 sites keep none); each site's setting comes back
    with state.collecting_stats(True):
        try:
            state.set_format(list(state.sites), "bf16")
            m = _Measurer(model, state, batches, seed)
            mine = []
            for i, (f, fmt) in enumerate(my_pairs):
                cost = m.measure(f, fmt, share[f])
                mine.append(cost)
                if progress is not None:
                    progress(i + 1, len(my_pairs), cost)
        finally:
            for f, fmt in was.items():
                state.sites[f].module.set_format(fmt)
            state.load_scaling_state(scaling)
    measured = mine
    if distributed and world > 1:
        measured = [SiteCost.from_dict(d) for part in from_every_rank([c.to_dict() for c in mine], group)
                    for d in part]
    by_pair = {(c.fqn, c.format): c for c in measured}
    entries = []
    for f in state.sites:
        for fmt in fmts[f]:
            src = by_pair.get((stand_in[f], fmt.name))
            if src is None:
                continue   # the stand-in was not profiled in this format (a ladder it lacks)
            entries.append(src if stand_in[f] == f else
                           replace(src, fqn=f, flop_share=share[f], estimated_from=src.fqn))
    x0 = batches[0][0]
    return Profile(entries=entries, reference_loss=m.ref_loss, batches=len(batches),
                   tokens_per_batch=int(x0.numel()), passes_per_rank=len(batches) * (1 + len(my_pairs)),
                   world=world, seconds=time.perf_counter() - t0,
                   sampled=len(profiled) if sample is not None else None)
