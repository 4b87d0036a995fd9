"""Stability signals: collected on the device every step, read on the host every check.

`Monitor` keeps, on the device and without host syncs, the per-step loss and global
grad norm of the current check window and the quantizer statistics of every site
(input, weight, grad_output; summed counts and max amax). Every `check_every` steps,
`Monitor.check()` packs all of it into one vector, combines it across ranks with one
collective (an all-gather of that vector, then sum / max / mean per field on every
rank, so every rank holds identical numbers), reads it on the host once, and returns
`Signals`: plain floats the controller decides on. Ranks that hold different sites
(pipeline stages) all pack every site of the model (`sites=`), zeros for the others'.
Between checks, when full statistics are off, each layer still counts on the device the
steps in which a delayed-scaling operand saturated (`SiteSignals.overflow_steps`), so a
one-step overflow is not missed; NaN/Inf anywhere reaches the loss or the grad norm,
which are looked at every step (`lowprec.policy.anomaly`).

The monitor only collects: what counts as an instability (thresholds, spike and
large-value detectors, the loss gap) is the controller's (`lowprec.policy.detectors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lowprec.numerics.quant_stats import QuantStats, sqnr_db
from lowprec.policy.router_signals import RouterSignals, router_windows

__all__ = ["MonitorConfig", "Signals", "SiteSignals", "Monitor", "ROLES"]

ROLES = ("input", "weight", "output", "grad_output")  # output: only its non-finite count is used
_COUNTED = ("input", "weight", "grad_output")   # PrecisionLinear.overflow_steps, in this order
_N = len(QuantStats.FIELDS)   # the packing: amax, saturated, underflow, sq_error, signal_power,
_NUMEL = QuantStats.FIELDS.index("numel")              # nonfinite, numel, underflow_energy
_NONFINITE = QuantStats.FIELDS.index("nonfinite")


@dataclass(frozen=True)
class MonitorConfig:
    """When to collect: the host reads the signals every `check_every` steps; quantizer
    statistics are gathered on check steps only unless `stats_every_step`."""

    check_every: int = 10
    stats_every_step: bool = False

    def __post_init__(self) -> None:
        if self.check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {self.check_every}")


@dataclass
class SiteSignals:
    """One site's signals over a check window, per operand role."""

    amax: dict[str, float] = field(default_factory=dict)
    saturated_frac: dict[str, float] = field(default_factory=dict)
    underflow_frac: dict[str, float] = field(default_factory=dict)
    # the share of the operand's energy (sum of squares) in the values flushed to zero:
    # what underflow costs, where underflow_frac counts values however small
    underflow_energy_frac: dict[str, float] = field(default_factory=dict)
    rel_mse: dict[str, float] = field(default_factory=dict)
    sqnr_db: dict[str, float] = field(default_factory=dict)
    nonfinite: dict[str, float] = field(default_factory=dict)
    # steps of the window, with full statistics off, in which a delayed-scaling operand saturated
    overflow_steps: dict[str, float] = field(default_factory=dict)
    # an expert's tokens routed to it over the window's statistics steps, all ranks (None: no expert)
    tokens: float | None = None

    def flat(self) -> dict[str, float]:
        """`role/stat` -> value, for logging."""
        out = {}
        for stat in ("amax", "saturated_frac", "underflow_frac", "underflow_energy_frac", "rel_mse", "sqnr_db",
                     "nonfinite", "overflow_steps"):
            for role, v in getattr(self, stat).items():
                out[f"{role}/{stat}"] = v
        if self.tokens is not None:
            out["routed/tokens"] = self.tokens
        return out


@dataclass
class Signals:
    """What one check saw: per-step loss and grad norm, and per-site quantizer signals;
    `lr_sensitivity` is the LR probe's (`lowprec.runtime.session.lrprobe`) when it ran for this check."""

    step: int
    losses: list[float]
    grad_norms: list[float]
    sites: dict[str, SiteSignals] = field(default_factory=dict)
    lr_sensitivity: float | None = None
    # each MoE layer's routing over the window's statistics steps, all ranks (experts module FQN ->)
    routers: dict[str, RouterSignals] = field(default_factory=dict)

    @property
    def nonfinite(self) -> bool:
        """Any step of the window had a non-finite loss or grad norm."""
        return any(not math.isfinite(v) for v in self.losses + self.grad_norms)


def site_signals_from_packed(rows: dict[str, list[float]]) -> SiteSignals:
    """SiteSignals from {role: [amax, saturated, underflow, sq_error, power, nonfinite, numel,
    underflow_energy]} (QuantStats.FIELDS)."""
    s = SiteSignals()
    for role, (amax, sat, und, err, power, nonfin, numel, und_energy) in rows.items():
        if numel <= 0:
            continue
        s.amax[role] = amax
        s.saturated_frac[role] = sat / numel
        s.underflow_frac[role] = und / numel
        s.underflow_energy_frac[role] = und_energy / power if power > 0 else 0.0
        s.rel_mse[role] = err / power if power > 0 else 0.0
        s.sqnr_db[role] = sqnr_db(power, err)
        s.nonfinite[role] = nonfin
    return s


class Monitor:
    """Collects signals on the device; `check()` reads them with one collective per check."""

    def __init__(self, state, config: MonitorConfig, *, group=None, sites: list[str] | None = None):
        """sites: every site of the model, in forward order, when `state` holds only some of
        them (a pipeline stage). Every rank then packs a row for every site, its own filled
        and the others zero, so that the one all-gather gives every rank the statistics of
        all sites (zeros change neither a max amax nor a sum). Default: `state`'s sites,
        which every rank must then have."""
        self.state = state
        self.config = config
        self.group = group
        self.sites = list(state.sites) if sites is None else list(sites)
        unlisted = [s for s in state.sites if s not in set(self.sites)]
        if unlisted:
            raise ValueError(f"sites= must list every site of the state; it lacks {unlisted[:4]}")
        # a linear site's weight, or an expert site's statistics buffer (lowprec.sites.experts)
        first = next(iter(state.sites.values())).module if state.sites else None
        dev = (torch.device("cpu") if first is None else first.weight.device if hasattr(first, "weight")
               else first.overflow_steps.device)
        self.device = dev
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []
        self._acc = torch.zeros(len(self.sites), len(ROLES), _N, dtype=torch.float64, device=dev)
        # per site: its share of tokens under even routing (top_k / E) if it is an expert
        # (lowprec.sites.experts), else 0, and its tokens over the window
        self._tokens = torch.zeros(2, len(self.sites), dtype=torch.float64)
        self._forced: int | None = None   # a step that must collect statistics and check
        self._collecting = False
        # each site's output: only whether it is finite (the origin of a NaN is the first
        # site, in forward order, whose inputs are finite and whose output is not). Only
        # where the check's statistics must find it: a session that replays anomalous steps
        # finds the origin by replay and turns this off (`origins_by_replay`)
        self.count_outputs = True
        self._hooks = [s.module.register_forward_hook(self._output_hook) for s in state.sites.values()]

    def _output_hook(self, module, args, output) -> None:
        if not (self._collecting and self.count_outputs) or not isinstance(output, torch.Tensor):
            return
        out = output.to_local() if hasattr(output, "to_local") else output
        # x * 0 is 0 for a finite x and NaN for NaN and +-Inf: one float pass and one count
        # (torch.isfinite takes four passes on CPU)
        packed = torch.zeros(_N, dtype=torch.float64, device=out.device)
        packed[_NONFINITE] = (out.detach() * 0).count_nonzero()
        packed[_NUMEL] = out.numel()
        module.stats["output"] = QuantStats(packed)

    def close(self) -> None:
        """Remove the output hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def force_check(self, step: int) -> None:
        """Make `step` collect statistics and be a check step (after a NaN/Inf step, so
        that the next check can see which site it comes from)."""
        self._forced = step

    def wants_stats(self, step: int) -> bool:
        """Whether step `step` should compute quantizer statistics (set on the layers)."""
        return self.config.stats_every_step or self.is_check_step(step)

    def origins_by_replay(self, replayed: bool) -> None:
        """Whether anomalous steps are replayed (which finds a NaN's origin): then the check
        steps need not count non-finite outputs."""
        self.count_outputs = not replayed

    def before_step(self, step: int) -> None:
        self._collecting = self.wants_stats(step)
        self.state.collect_stats(self._collecting)

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """After backward: keep this step's loss, grad norm and site statistics (no sync)."""
        self._losses.append(loss.detach().reshape(()).double())
        self._norms.append(grad_norm.detach().reshape(()).double().to(loss.device))
        self.record_statistics(step)

    def record_statistics(self, step: int) -> None:
        """After backward: keep this step's site statistics only (no sync). For a loop that
        does not hand the loss and grad norm over (torchtitan's model converters see neither):
        its checks then have empty `losses` and `grad_norms`."""
        if not self.wants_stats(step):
            return
        rows, packed = [], []
        for i, fqn in enumerate(self.sites):
            if fqn not in self.state.sites:
                continue   # another rank's site (pipeline stage): its row stays zero here
            module = self.state.sites[fqn].module
            if hasattr(module, "take_tokens"):
                self._tokens[0, i] = float(module.routed_fraction)
                self._tokens[1, i] += module.take_tokens()
            stats = module.stats
            for j, role in enumerate(ROLES):
                st = stats.get(role)
                if st is not None:
                    rows.append(i * len(ROLES) + j)
                    packed.append(st.packed)
            stats.clear()
        if not rows:
            return
        # one update of the window for all sites and roles (each (site, role) once)
        p = torch.stack(packed).to(self._acc.device)
        acc = self._acc.view(-1, _N)
        idx = torch.tensor(rows, device=acc.device)
        acc[idx, :1] = torch.maximum(acc[idx, :1], p[:, :1])
        acc[idx, 1:] += p[:, 1:]

    def discard(self, step: int) -> None:
        """Leave step `step` out of the window: its site statistics are dropped unread (a
        step that was replayed and decided on its own)."""
        for site in self.state.sites.values():
            site.module.stats.clear()

    def _overflow_steps(self) -> torch.Tensor:
        """Every site's between-check overflow counts (zeros for other ranks' sites), taken
        and reset: one stack of small device tensors per check, no sync."""
        rows = [getattr(self.state.sites[f].module, "overflow_steps", None) if f in self.state.sites else None
                for f in self.sites]
        zero = torch.zeros(len(_COUNTED), dtype=torch.float64, device=self._acc.device)
        out = torch.stack([zero if r is None else r.to(self._acc.device) for r in rows]) if rows else \
            torch.zeros(0, len(_COUNTED), dtype=torch.float64, device=self._acc.device)
        for r in rows:
            if r is not None:
                r.zero_()
        return out

    def is_check_step(self, step: int) -> bool:
        return (step + 1) % self.config.check_every == 0 or step == self._forced

    def check(self, step: int) -> Signals:
        """Pack, combine across ranks (one all-gather), read once, reset the window."""
        n_steps = len(self._losses)
        steps = torch.stack([torch.stack(self._losses), torch.stack(self._norms)]) if n_steps else \
            torch.zeros(2, 0, dtype=torch.float64, device=self._acc.device)
        overflow = self._overflow_steps()
        packed = torch.cat([self._acc.flatten(), overflow.flatten(), steps.flatten().to(self._acc.device),
                            self._tokens.flatten().to(self._acc.device)])
        if self.group is not None or (dist.is_available() and dist.is_initialized()):
            world = dist.get_world_size(self.group)
            gathered = [torch.empty_like(packed) for _ in range(world)]
            dist.all_gather(gathered, packed, group=self.group)
            allp = torch.stack(gathered)
        else:
            allp = packed.unsqueeze(0)
        host = allp.cpu()
        acc = host[:, :self._acc.numel()].reshape(-1, len(self.sites), len(ROLES), _N)
        site_rows = torch.cat([acc[..., :1].amax(0), acc[..., 1:].sum(0)], dim=-1)
        n_acc, n_over = self._acc.numel(), overflow.numel()
        between = host[:, n_acc:n_acc + n_over].reshape(-1, *overflow.shape).amax(0)   # ranks count alike
        n_tok = self._tokens.numel()
        tokens = host[:, host.shape[1] - n_tok:].reshape(-1, *self._tokens.shape)
        expert, routed = tokens[:, 0].amax(0).tolist(), tokens[:, 1].sum(0).tolist()   # tokens of all ranks
        per_step = host[:, n_acc + n_over:host.shape[1] - n_tok].reshape(host.shape[0], 2, n_steps)
        losses = per_step[:, 0].mean(0).tolist()          # data-parallel ranks: the global mean
        norms = per_step[:, 1].amax(0).tolist()           # already reduced; max guards against drift
        sites = {}
        for i, fqn in enumerate(self.sites):
            rows = {role: site_rows[i, j].tolist() for j, role in enumerate(ROLES) if site_rows[i, j, _NUMEL] > 0}
            if rows or between[i].any():
                sites[fqn] = site_signals_from_packed(rows)
                sites[fqn].overflow_steps = {r: v for r, v in zip(_COUNTED, between[i].tolist()) if v > 0}
            if expert[i]:
                sites.setdefault(fqn, SiteSignals()).tokens = routed[i]
        routers = router_windows({f: routed[i] for i, f in enumerate(self.sites) if expert[i]},
                                 {f: expert[i] for i, f in enumerate(self.sites) if expert[i]})
        self._losses, self._norms = [], []
        self._acc.zero_()
        self._tokens.zero_()
        self._forced = None
        return Signals(step=step, losses=losses, grad_norms=norms, sites=sites, routers=routers)
