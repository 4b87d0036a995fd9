"""Benchmark: does the controller blame precision only when precision is to blame, and the right site?

A campaign of planted faults on the reference model (the default config's small GPT on
Shakespeare, the default staged rollout: every block's linear layers in FP8, the middle
MLPs in NVFP4, `lm_head` in BF16). The model is first trained for WARM steps (all three
stages promote); every fault then starts from that same state (model, optimizer,
controller, RNG), is planted at step FAULT_AT and the run goes on to step END.

Precision faults (they live in the quantized path only, so a replay in high precision
removes them, and so does the site's fallback), each on a site drawn from the
low-precision sites, from FAULT_AT on for as long as the site stays in low precision:
  * `scale`: the site's dequantization scale off by 2^12 (a corrupt scale_inv);
  * `flush`: the scale computed from an amax 2^16 too large, so FP8/FP4 flush the operand
    to zero (a layer's activations shrunk below the format's range);
  * `saturate`: the scale from an amax 2^8 too small, so the operand saturates at the
    format's max (outliers beyond a stale delayed-scaling amax);
  * `fp4`: the site quantized in FP4 E2M1 with one scale per tensor (a too aggressive
    format on a layer).
Other faults (precision is not to blame): `lr_spike` (learning rate x100 for 3 steps),
`garbage` (one batch of uniformly random bytes), `nan_input` (NaN in the token embeddings
for one step), `grad_spike` (the loss, and so every gradient, x1000 for one step).

The seeds, sites and kinds are fixed below, before any run (no tuning on the campaign).
Prints first the control (the same steps from the warm state, no fault: a step it acts on is
a healthy batch's own, marked * in the rows and left out of the detection figures), then, per
fault, the steps acted on, the steps and sites that fell back or rolled back, the actions, the
replays and their cost, then the totals.

    python -m experiments.attribution_bench                 # the campaign, replays on
    python -m experiments.attribution_bench --no-replay     # the same faults, statistics rules only
    python -m experiments.attribution_bench --kinds lr_spike,garbage --per-kind 2   # a subset
    python -m experiments.attribution_bench --start 35      # resume: the faults numbered 35 on
    python -m experiments.attribution_bench --drift         # drift faults: loss gap, eval gate (attribution_drift)
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.data import Batches, shakespeare_tokens
from experiments.model import build_gpt
from lowprec.policy.events import EventKind
from lowprec.numerics.formats import get_format
from lowprec.sites.plan import PrecisionPlan
from lowprec.numerics.quantize import quantize
from lowprec.policy.rollout import parse_rollout
from lowprec.runtime import Session

WARM, FAULT_AT, END = 160, 165, 185
PRECISION_KINDS = ("scale", "flush", "saturate", "fp4")
OTHER_KINDS = ("lr_spike", "garbage", "nan_input", "grad_spike")
SEEDS = {kind: list(range(100 * i, 100 * i + 6)) for i, kind in enumerate(PRECISION_KINDS)} | \
        {kind: list(range(1000 + 100 * i, 1000 + 100 * i + 5)) for i, kind in enumerate(OTHER_KINDS)}
# A precision fault lasts as long as its site stays in low precision (a format that cannot
# represent a layer's operands keeps failing until the layer falls back); the others are
# events of a few steps. (A first campaign gave precision faults 2 steps: see docs/results.md.)
DURATION = {"scale": END, "flush": END, "saturate": END, "fp4": END, "lr_spike": 3, "garbage": 1, "nan_input": 1,
            "grad_spike": 1}

PLAN = {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["lm_head"]}],
        "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                   "ladder": ["fp8_tensorwise", "bf16"]},
                  {"name": "middle_mlp", "select": {"regex": r"blocks\.[12]\.mlp\..*"}, "format": "bf16",
                   "ladder": ["nvfp4", "fp8_tensorwise", "bf16"]}]}
ROLLOUT = {"check_every": 10, "min_steps": 30, "cooldown_steps": 1000, "quarantine_after": 2,
           "rewind": {"enabled": True, "skip_batches": 5, "snapshot_every": 20, "keep": 2},
           # site rules as a user would set them: saturation above 0.1%, more than 1% of an
           # operand's energy flushed to zero (FP8/NVFP4 flush far less on this model)
           "thresholds": {"max_saturated_frac": 1e-3, "max_underflow_energy": 0.01, "site_patience": 2},
           "stages": [{"name": "mlp_fp8", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_tensorwise"},
                      {"name": "attn_fp8", "select": {"glob": "blocks.*.attn.*"}, "format": "fp8_tensorwise"},
                      {"name": "middle_mlp_nvfp4", "select": {"regex": r"blocks\.[12]\.mlp\..*"},
                       "format": "nvfp4"}]}


@dataclass(frozen=True)
class Fault:
    kind: str
    seed: int
    site: str = ""

    @property
    def precision(self) -> bool:
        return self.kind in PRECISION_KINDS

    def active(self, time: int) -> bool:
        """At loop pass `time` (counted like steps from WARM, rewinds included: after a rewind
        the step counter goes back, time does not, so a fault happens once, as a real one)."""
        return FAULT_AT <= time < FAULT_AT + DURATION[self.kind]


def campaign(sites: list[str]) -> list[Fault]:
    """The faults, from the seeds above: a precision fault's site is drawn with its seed."""
    out = []
    for kind in PRECISION_KINDS + OTHER_KINDS:
        for seed in SEEDS[kind]:
            site = random.Random(seed).choice(sites) if kind in PRECISION_KINDS else ""
            out.append(Fault(kind, seed, site))
    return out


class FaultyQuantizer:
    """A site's `OperandQuantizer` (lowprec.sites.operand_quantizer) whose `quantize` is a
    fault's; every other attribute is the site's own."""

    def __init__(self, inner, quantize):
        self.inner, self.quantize = inner, quantize

    def __getattr__(self, name):
        return getattr(self.inner, name)


def plant_quantize(module, wrap) -> None:
    """Route `module`'s quantizations through `wrap(original quantize)` until `unplant_quantize`:
    the layer hands `QuantizedLinearFn` a `FaultyQuantizer` for every call."""
    factory = module.operand_quantizer

    def operand_quantizer():
        q = factory()
        return FaultyQuantizer(q, wrap(q.quantize))
    module.operand_quantizer = operand_quantizer


def unplant_quantize(module) -> None:
    del module.operand_quantizer   # the class's own method again


class Planted:
    """Installs one fault on the model for the loop passes it is active (`step` is the pass,
    set by the loop)."""

    def __init__(self, fault: Fault, model, state, opt):
        self.fault, self.model, self.state, self.opt = fault, model, state, opt
        self.step = 0
        self.hooks = []
        self.planted = None
        if fault.precision:
            self.planted = module = state.sites[fault.site].module
            plant_quantize(module, lambda original: self._quantize(module, original))
        elif fault.kind == "nan_input":
            self.hooks.append(model.tok_emb.register_forward_hook(self._nan_embedding))
        elif fault.kind == "grad_spike":
            self.hooks.append(model.register_forward_hook(self._scale_loss))

    def _quantize(self, module, original):
        fault = self.fault
        fp4 = get_format("fp4_tensorwise")

        def quantize_operand(t, fmt, role, **kw):
            if not fault.active(self.step) or role not in ("input", "weight", "grad_output", "input_wgrad",
                                                           "grad_output_wgrad"):
                return original(t, fmt, role, **kw)
            if fault.kind == "fp4":
                return original(t, fp4, role, **kw)
            spec = getattr(fmt, role)
            if spec is None:
                return original(t, fmt, role, **kw)
            if fault.kind == "scale":
                q = original(t, fmt, role, **kw)
                return type(q)(q.values, q.scale * 2.0 ** -12, q.scale_inv * 2.0 ** 12, q.spec, q.shape, q.amax)
            amax = torch.where(torch.isfinite(t), t.abs(), 0.0).amax().float()
            amax = amax * (2.0 ** 16 if fault.kind == "flush" else 2.0 ** -8)
            counted = (module.collect_stats and kw.get("record", True)
                       and role in ("input", "weight", "grad_output"))
            q = quantize(t, spec, amax=amax, generator=module.generator, hadamard=module.hadamard,
                         stats=counted, validate=False)
            if counted:   # the monitors see the faulty quantization as they see any other
                module.stats[role] = q.stats
            return q
        return quantize_operand

    def _nan_embedding(self, mod, args, out):
        if self.fault.active(self.step):
            out = out.clone()
            out[0, 0, 0] = float("nan")
            return out

    def _scale_loss(self, mod, args, out):
        if self.fault.active(self.step):
            return out[0], out[1] * 1000.0

    def batch(self, data, step):
        x, y = data.next()
        if self.fault.kind == "garbage" and self.fault.active(step):
            g = torch.Generator().manual_seed(self.fault.seed)
            x = torch.randint(0, 256, x.shape, generator=g)
            y = torch.randint(0, 256, y.shape, generator=g)
        return x, y

    def lr_factor(self, step):
        return 100.0 if self.fault.kind == "lr_spike" and self.fault.active(step) else 1.0

    def remove(self):
        for h in self.hooks:
            h.remove()
        if self.planted is not None:
            unplant_quantize(self.planted)


def build(replay: bool):
    torch.manual_seed(0)
    model = build_gpt(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    rollout = parse_rollout({**ROLLOUT, "attribution": {"replay": replay}})
    session = Session.build(model, opt, PrecisionPlan.from_dict(PLAN), rollout)
    return model, opt, session


def train(model, session, data, steps, planted=None, lr=3e-3, warmup=20):
    times = []
    time_ = session.step_index
    while session.step_index < steps:
        step = session.step_index
        if planted is not None:
            planted.step = time_
        time_ += 1
        factor = planted.lr_factor(planted.step) if planted is not None else 1.0
        for g in session.optimizer.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * factor
        x, y = planted.batch(data, planted.step) if planted is not None else data.next()

        def closure():
            _, loss = model(x, y)
            loss.backward()
            return loss
        t0 = time.perf_counter()
        loss = closure()
        result = session.step(loss, closure)
        times.append((step, time.perf_counter() - t0, len(result.attribution.replays) if result.attribution else 0))
    return times


def restore_warm(warm: dict, model, opt, session, *, controller: bool = True) -> None:
    """Load the warm state (`main`'s `warm`) into a freshly built run: the model, the optimizer,
    the precision state and, with `controller`, the session's. Copies: an optimizer loads its
    state's tensors without copying them, so the AdamW moments would alias the warm state's
    and every run would start where the one before it ended."""
    model.load_state_dict(warm["model"])
    opt.load_state_dict(copy.deepcopy(warm["opt"]))
    session.state.load_state_dict(copy.deepcopy(warm["precision"]))
    if controller:
        session.load_state_dict(copy.deepcopy(warm["session"]))


def seed_positions(text: str) -> set[int]:
    """`--seed-index`'s positions ("1,2" -> {1, 2})."""
    return {int(x) for x in text.split(",") if x.strip()}


ACTED = (EventKind.SKIP_STEP, EventKind.FALLBACK, EventKind.ROLLBACK, EventKind.REWIND)


def run_fault(warm: dict, data, fault: Fault | None, replay: bool):
    """One run from the warm state to END with `fault` planted (None: the control); its events
    from FAULT_AT on and its steps' (step, seconds, replays)."""
    model, opt, session = build(replay)
    restore_warm(warm, model, opt, session)
    session.events = []
    session.snapshots.kept.clear()
    session.snapshots.take(WARM)
    data.load_state_dict(warm["data"])
    torch.set_rng_state(warm["rng"])
    planted = Planted(fault, model, session.state, opt) if fault is not None else None
    try:
        times = train(model, session, data, END, planted)
    finally:
        if planted is not None:
            planted.remove()
        session.close()
    return [e for e in session.events if e.step >= FAULT_AT], times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-replay", action="store_true", help="statistics rules only (the controller before replays)")
    p.add_argument("--kinds", default=",".join(PRECISION_KINDS + OTHER_KINDS),
                   help="comma-separated fault kinds to run (default: all)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: immune to the oversubscription of a shared machine)")
    p.add_argument("--per-kind", type=int, default=0, help="run only the first N seeds of each kind (0: all)")
    p.add_argument("--drift", action="store_true", help="the drift campaign (experiments.attribution_drift): "
                                                         "loss-gap and eval-gate faults judged by their window")
    p.add_argument("--drift-kinds", default="", help="comma-separated drift fault kinds (default: all)")
    p.add_argument("--drift-events", action="store_true", help="print each drift fault's events after its row")
    p.add_argument("--onset-by-step", action="store_true",
                   help="a precision drift fault is on from training step 165 (a retrained window meets it at the "
                        "same steps), not from loop pass 165 (it meets it from the window's start)")
    p.add_argument("--seed-index", default="",
                   help="comma-separated positions of the seeds to run in each kind's list (0: the first; "
                        "default: all): `--seed-index 1,2` runs what `--per-kind 1` left out")
    p.add_argument("--start", type=int, default=0,
                   help="resume a campaign: skip the faults numbered below N in its table (the # column)")
    p.add_argument("--warm-cache", default="", help="keep the warm state in this file, and start from it when it exists")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = Batches(shakespeare_tokens(2_000_000), 16, 128, seed=0)
    model, opt, session = build(not args.no_replay)
    t0 = time.perf_counter()
    if args.warm_cache and Path(args.warm_cache).exists():   # the warm state of an earlier run: the same
        cached = torch.load(args.warm_cache, weights_only=False)
        model.load_state_dict(cached["model"])
        opt.load_state_dict(cached["opt"])
        session.state.load_state_dict(cached["precision"])
        session.load_state_dict(cached["session"])
        data.load_state_dict(cached["data"])
        torch.set_rng_state(cached["rng"])
    else:
        train(model, session, data, WARM)
    warm_s = time.perf_counter() - t0
    low = [s for s, f in session.controller.current.items() if f != "bf16"]
    print(f"# warm-up: {WARM} steps in {warm_s:.0f} s; promoted {session.controller.promoted} stages; "
          f"{len(low)} low-precision sites; replays {'on' if not args.no_replay else 'off'}")
    warm = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
            "session": copy.deepcopy(session.state_dict()), "precision": copy.deepcopy(session.state.state_dict()),
            "data": data.state_dict(), "rng": torch.get_rng_state()}
    session.close()
    if args.warm_cache and not Path(args.warm_cache).exists():
        torch.save(warm, args.warm_cache)
    if args.drift:
        from experiments.attribution_drift import campaign_main
        campaign_main(args, data, warm, low, PLAN, ROLLOUT, WARM)
        return
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(PRECISION_KINDS + OTHER_KINDS))
    if unknown:
        p.error(f"unknown fault kinds {unknown}; kinds: {', '.join(PRECISION_KINDS + OTHER_KINDS)}")
    faults = [f for f in campaign(low) if f.kind in kinds]
    if args.per_kind:
        faults = [f for f in faults if SEEDS[f.kind].index(f.seed) < args.per_kind]
    if args.seed_index:
        faults = [f for f in faults if SEEDS[f.kind].index(f.seed) in seed_positions(args.seed_index)]
    # the control: the same 25 steps from the warm state with no fault; a step it acts on (a healthy
    # batch's own spike) is marked * in the faults' rows and left out of their detection figures
    control_ev, _ = run_fault(warm, data, None, not args.no_replay)
    control = sorted({e.step for e in control_ev if e.kind in ACTED})
    print(f"# control (no fault): acted on steps {control or 'none'}: "
          f"{'; '.join(f'{e.step} {e.kind}: {e.reason}' for e in control_ev if e.kind in ACTED) or '-'}")
    print("| # | fault | seed | site | acted at | blamed at | blamed | actions | replays | replay s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for i, fault in enumerate(faults):
        if i < args.start:
            continue
        ev, times = run_fault(warm, data, fault, not args.no_replay)
        acted = [e for e in ev if e.kind in ACTED]
        demoted = [e for e in ev if e.kind in (EventKind.FALLBACK, EventKind.ROLLBACK)]
        blamed = sorted({s for e in demoted for s in e.sites})
        actions = sorted({e.kind for e in acted})
        plain = sorted(t for _, t, n in times if n == 0)
        median = plain[len(plain) // 2]
        replays = sum(n for _, _, n in times)
        replay_s = sum(t - median for _, t, n in times if n)
        steps = sorted({e.step for e in acted})
        first = min((s for s in steps if s not in control), default=None)
        if fault.precision:
            ok = blamed == [fault.site]
        else:
            ok = not blamed
        first_skip = min((e.step for e in ev if e.kind == EventKind.SKIP_STEP and e.step not in control), default=None)
        rows.append((fault, first, blamed, ok, replays, replay_s, sum(1 for _, _, n in times if n), first_skip))
        acted_at = ", ".join(f"{s}{'*' if s in control else ''}" for s in steps) or "-"
        blamed_at = ", ".join(str(s) for s in sorted({e.step for e in demoted})) or "-"
        print(f"| {i} | {fault.kind} | {fault.seed} | {fault.site or '-'} | {acted_at} | {blamed_at} | "
              f"{', '.join(blamed) or '-'} | {', '.join(actions) or '-'} | {replays} | {replay_s:.2f} |", flush=True)
    prec = [r for r in rows if r[0].precision]
    other = [r for r in rows if not r[0].precision]
    anomalies = sum(r[6] for r in rows)
    print()
    print(f"precision faults attributed to exactly the planted site: {sum(r[3] for r in prec)}/{len(prec)}")
    print(f"other faults that demoted a site: {sum(not r[3] for r in other)}/{len(other)}")
    anomalous = [r for r in rows if r[7] is not None]
    on_time = [r for r in anomalous if r[7] <= FAULT_AT + (1 if r[0].kind == "lr_spike" else 0)]
    print(f"faults that made a step anomalous (steps the control acted on not counted): {len(anomalous)}/{len(rows)}; "
          f"acted on at the step the anomaly "
          f"showed (the fault's first step; the one after for lr_spike): {len(on_time)}/{len(anomalous)}")
    if anomalies:
        print(f"replays: {sum(r[4] for r in rows)} over {anomalies} replayed steps "
              f"({sum(r[4] for r in rows) / anomalies:.1f} per anomaly), "
              f"{sum(r[5] for r in rows) / anomalies:.2f} s per anomaly (a plain step: {median:.2f} s)")


if __name__ == "__main__":
    main()
