"""Benchmark, slow signals: does a loss gap or an eval regression demote only what precision caused?

The drift campaign of `experiments.attribution_bench` (`python -m experiments.attribution_bench
--drift`): the same reference model, rollout and warm state (160 steps, three stages
promoted), now with `thresholds.loss_gap` against a BF16 baseline (the warm state trained on
with every site in BF16, on the same batches, no fault) and the window judgment on (the
defaults of `rollout.attribution`). Each fault starts at step FAULT_AT; the run goes on to END.

Non-precision drift faults (they live in the data or the schedule: the same in BF16), each
part of its steps' batches, so a window replay meets them again:
  * `input_scale`: one block's input x8 for 5 steps;
  * `shuffle`: 10 batches whose tokens are shuffled within each sequence;
  * `repeat`: one batch repeated for 15 steps;
  * `lr_schedule`: the learning rate x5 for 20 steps (the replay uses the LRs the steps used).
A step-tied non-precision fault, which a window trained again later does not meet (the
window judgment's control, the same window trained again as configured, tells it apart):
  * `step_input`: the input of one of blocks 1-3 (not block 0, where the stages' sites that
    matter are) x1e4 on 4 fixed loop passes, whatever the batch;
  * `step_layer`: the input of one low-precision layer that the judgment's first subset (the
    newest stage, `middle_mlp_nvfp4`: blocks 1-2's MLP layers) does not contain, x1e4 on 4
    fixed loop passes: a healthy first subset must not be blamed for a fault elsewhere.
Precision drift faults (in the quantized path of one site, drawn with the seed from its
kind's `SITES`, for as long as the site stays in low precision; t: steps since the fault
began):
  * `underflow`: the site's gradients quantized from an amax 4^t too large, so ever more of
    them flush to zero (the layer stops learning, and so do the layers before it through it);
  * `saturation`: the site's input quantized from an amax 2^(t/8) too small: a slowly growing
    saturation;
  * `slight_scale`: the site's weight dequantized with a scale 6-8x too small (the factor
    drawn with the seed): a wrong scale that raises the loss by 2% for about ten steps.

Calibration (2026-11-27; the first pass, with amax 2^(t/2), 2^(t/4) and a wrong scale of x3
on any of the 16 sites, raised the loss gap past `loss_gap` for none of its faults in 50
steps): on this model after 160 steps nearly all of the work is done by block 0 (ablating
block 0's MLP layers raises the held-out loss 45%, its attention layers 2%; any layer of
blocks 1-3, 0.4% at most), so a precision fault elsewhere changes the loss too little for
any loss signal to see, whatever its strength. The sites are therefore drawn from block 0,
and the strengths chosen so that each fault, left alone (site thresholds off), shows in the
loss within the run: the underflow (on `blocks.0.mlp.proj`) raises the smoothed gap past 0.015
at step 189 and keeps it near 0.02; the wrong scale on the QKV projection (attention logits
x1/36-x1/64; tried at /6.7 and /8) keeps it at 0.017-0.020 from step 165 to 175 and the
held-out loss 1.6% above the baseline's at 170, with no spike. A wrong scale is a reparametrisation that the
optimizer undoes (the weights grow back within ~10 steps): larger or on other sites it
spiked the grad norm within its first steps (the per-step replays then caught it: /4 or /10
on an MLP layer, x3 on the QKV projection), smaller or ramped in slowly it never crossed the
gap (/4 on block 0's attention output 0.011; ramped over 50 steps to /18 or x8 on the MLP
layers: 0.013 at most). The saturation, left alone, does not
raise the gap: it spikes the grad norm at step 189; its own statistics (0.1% saturated)
demote the site at step 179 first. The non-precision faults are unchanged.

Eval-gate regressions: a held-out loss every 10 steps against the baseline's at the same
step (a regression above 1%), with `loss_gap` set out of reach (1.0) so that only the gate
acts: `eval_scale` (the `slight_scale` fault, precision) and `eval_shuffle` (the `shuffle`
fault, not precision).
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch

from experiments.attribution_bench import ROLLOUT, plant_quantize, restore_warm, seed_positions, unplant_quantize
from experiments.model import build_gpt
from lowprec.policy.events import EventKind
from lowprec.sites.plan import PrecisionPlan
from lowprec.numerics.quantize import quantize
from lowprec.policy.rollout import parse_rollout
from lowprec.runtime import Session
from lowprec.policy.verdicts import Verdict

FAULT_AT, END, EVAL_EVERY, EVAL_TOL = 165, 215, 10, 0.01
OTHER = ("input_scale", "shuffle", "repeat", "lr_schedule", "step_input", "step_layer", "eval_shuffle")
PRECISION = ("underflow", "saturation", "slight_scale", "eval_scale")
# seeds by kind, in the order the kinds were added (a new kind takes the next hundred: the others keep theirs)
_ADDED = ("input_scale", "shuffle", "repeat", "lr_schedule", "eval_shuffle") + PRECISION + ("step_input", "step_layer")
SEEDS = {k: list(range(2000 + 100 * i, 2000 + 100 * i + 3)) for i, k in enumerate(_ADDED)}
EVAL_OF = {"eval_scale": "slight_scale", "eval_shuffle": "shuffle"}   # an eval-gate kind and the fault it plants
DURATION = {"input_scale": 5, "shuffle": 10, "repeat": 15, "lr_schedule": 20, "step_input": 4, "step_layer": 4,
            "eval_shuffle": 10}
STEP_INPUT = 1e4   # `step_input`, `step_layer`: the input's factor on their fixed steps
# `step_layer`'s layers: not in the newest stage, the first subset the window judgment tries
FIRST_SUBSET = re.compile(ROLLOUT["stages"][-1]["select"]["regex"])
LOSS_GAP = {"loss_gap": 0.015, "loss_gap_smoothing": 0.5}
# The precision faults' calibration (module docstring): the amax's exponent of 2 per step of
# the underflow (grows) and the saturation (shrinks), the wrong scale's range (the weight's
# dequantization scale divided by a factor drawn with the seed), and the sites each kind is
# drawn from (the layers whose output matters on this model, see the docstring).
UNDERFLOW_PER_STEP, SATURATION_PER_STEP, WRONG_SCALE = 2.0, 0.125, (6.0, 8.0)
SITES = {"underflow": ("blocks.0.mlp.fc", "blocks.0.mlp.proj"),
         "saturation": ("blocks.0.mlp.fc", "blocks.0.mlp.proj"),
         "slight_scale": ("blocks.0.attn.qkv",), "eval_scale": ("blocks.0.attn.qkv",)}


@dataclass(frozen=True)
class Drift:
    kind: str
    seed: int
    site: str = ""

    @property
    def precision(self) -> bool:
        return self.kind in PRECISION

    @property
    def eval_gate(self) -> bool:
        return self.kind in EVAL_OF

    @property
    def base_kind(self) -> str:
        """The fault planted: an eval-gate kind plants its training fault (`eval_scale`: `slight_scale`)."""
        return EVAL_OF.get(self.kind, self.kind)

    @property
    def wrong_scale(self) -> float:
        """`slight_scale`'s factor: the weight's dequantization scale is this much too small."""
        return random.Random(self.seed + 1).uniform(*WRONG_SCALE)

    def active(self, t: int) -> bool:
        return t >= FAULT_AT if self.precision else FAULT_AT <= t < FAULT_AT + DURATION[self.kind]


def campaign(sites: list[str], kinds) -> list[Drift]:
    """The faults of `kinds`, three seeds each; a precision fault's site drawn with its seed
    from its kind's `SITES` that run in low precision (`sites`), a `step_layer`'s from the
    low-precision sites outside the first subset."""
    def site(kind: str, seed: int) -> str:
        pool = ([x for x in sites if not FIRST_SUBSET.match(x)] if kind == "step_layer"
                else [x for x in SITES[kind] if x in sites])
        if not pool:
            raise ValueError(f"none of {kind}'s sites {SITES.get(kind, 'outside the first subset')} "
                             f"runs in low precision here")
        return random.Random(seed).choice(pool)
    return [Drift(k, s, site(k, s) if k in PRECISION + ("step_layer",) else "")
            for k in OTHER + PRECISION if k in kinds
            for s in SEEDS[k]]


class PlantedDrift:
    """One drift fault on the model; `batch(data, t)` gives loop pass `t`'s batch and the flag
    its closure sets, so that a replay of that step meets the fault again.

    A precision fault's clock (`by_step`): False, the loop's passes (on from pass FAULT_AT for
    as long as the site is low precision: a fault that appears at a moment and stays, which a
    window trained again from an older snapshot meets from the window's first step, earlier
    than the run did); True, the training step being run (`step`, set by each step's closure:
    a fault that recurs at the same steps when they are trained again, as a deterministic one
    of the weights, data and scaling state a snapshot restores does)."""

    def __init__(self, fault: Drift, model, state, by_step: bool = False):
        self.fault, self.model, self.state, self.by_step = fault, model, state, by_step
        self.t, self.step, self.now, self.hooks, self.module = 0, 0, False, [], None
        kind = fault.base_kind
        if fault.precision:
            self.module = state.sites[fault.site].module
            module = self.module
            plant_quantize(module, lambda original: self._quantize(module, original, kind))
        elif kind == "input_scale":
            block = model.blocks[random.Random(fault.seed).randrange(len(model.blocks))]
            self.hooks.append(block.register_forward_pre_hook(
                lambda mod, args: (args[0] * 8.0,) + args[1:] if self.now else None))
        elif kind == "step_input":   # tied to the loop's passes, not to the batch: a later replay misses it
            block = model.blocks[1 + random.Random(fault.seed).randrange(len(model.blocks) - 1)]
            self.hooks.append(block.register_forward_pre_hook(
                lambda mod, args: (args[0] * STEP_INPUT,) + args[1:] if self.fault.active(self.t) else None))
        elif kind == "step_layer":   # one layer outside the first subset, on fixed passes
            self.hooks.append(state.sites[fault.site].module.register_forward_pre_hook(
                lambda mod, args: (args[0] * STEP_INPUT,) + args[1:] if self.fault.active(self.t) else None))

    def _quantize(self, module, original, kind):
        def quantize_operand(t, fmt, role, **kw):
            spec = getattr(fmt, role, None)
            clock = self.step if self.by_step else self.t
            if not self.fault.active(clock) or spec is None:
                return original(t, fmt, role, **kw)
            k = clock - FAULT_AT + 1
            if kind == "slight_scale" and role == "weight":
                q = original(t, fmt, role, **kw)
                f = 1.0 / self.fault.wrong_scale
                return type(q)(q.values, q.scale / f, q.scale_inv * f, q.spec, q.shape, q.amax)
            if (kind == "underflow" and role.startswith("grad_output")) or (kind == "saturation" and role == "input"):
                amax = torch.where(torch.isfinite(t), t.abs(), 0.0).amax().float()
                amax = amax * (2.0 ** (k * UNDERFLOW_PER_STEP) if kind == "underflow" else 2.0 ** (-k * SATURATION_PER_STEP))
                counted = module.collect_stats and kw.get("record", True) and role in ("input", "grad_output")
                q = quantize(t, spec, amax=amax, generator=module.generator, hadamard=module.hadamard,
                             stats=counted, validate=False)
                if counted:
                    module.stats[role] = q.stats
                return q
            return original(t, fmt, role, **kw)
        return quantize_operand

    def batch(self, data, t: int, repeated: dict):
        x, y = data.next()
        kind = self.fault.base_kind
        on = not self.fault.precision and self.fault.active(t)
        if on and kind == "shuffle":
            g = torch.Generator().manual_seed(self.fault.seed * 1000 + t)
            seq = torch.cat([x, y[:, -1:]], 1)
            seq = seq[:, torch.randperm(seq.shape[1], generator=g)]
            x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        if on and kind == "repeat":
            x, y = repeated.setdefault("xy", (x, y))
        return x, y, on and kind == "input_scale"

    def lr_factor(self, t: int) -> float:
        return 5.0 if self.fault.kind == "lr_schedule" and self.fault.active(t) else 1.0

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        if self.module is not None:
            unplant_quantize(self.module)


def held_out_loss(model, batches) -> float:
    with torch.no_grad():
        return sum(float(model(x, y)[1]) for x, y in batches) / len(batches)


@dataclass(frozen=True)
class _Outcome:
    verdict: Verdict
    reason: str


def run(model, session, data, end, planted=None, held=None, base_eval=None, lr=3e-3, warmup=20, hp=False):
    """Train to `end`; returns (losses by step, held-out losses by step, seconds per plain step)."""
    losses, evals, plain, repeated = {}, {}, [], {}
    t = session.step_index
    while session.step_index < end:
        step = session.step_index
        if planted is not None:
            planted.t = t
        factor = planted.lr_factor(t) if planted is not None else 1.0
        for g in session.optimizer.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * factor
        x, y, scaled = planted.batch(data, t, repeated) if planted is not None else (*data.next(), False)
        t += 1

        def closure(x=x, y=y, scaled=scaled, step=step):
            if planted is not None:
                planted.now, planted.step = scaled, step
            _, loss = model(x, y)
            loss.backward()
            return loss

        def forward(x=x, y=y, scaled=scaled, step=step):
            if planted is not None:
                planted.now, planted.step = scaled, step
            return model(x, y)[1]
        t0 = time.perf_counter()
        judged = len(session.window.judged) if session.window is not None else 0
        loss = closure()
        result = session.step(loss, closure, forward=forward)
        if planted is not None:
            planted.now = False
        if result.rewound_to is None:
            losses[step] = float(result.loss)
        if not result.attribution and (session.window is None or len(session.window.judged) == judged):
            plain.append(time.perf_counter() - t0)
        if held is not None and result.rewound_to is None and (step + 1) % EVAL_EVERY == 0:
            evals[step + 1] = held_out_loss(model, held)
            if base_eval is not None and step + 1 in base_eval:
                worse = evals[step + 1] > base_eval[step + 1] * (1 + EVAL_TOL)
                session.after_eval(step + 1, _Outcome(Verdict.REGRESS if worse else Verdict.PASS,
                                                      f"held-out loss {evals[step + 1]:.4f}"))
    return losses, evals, sorted(plain)[len(plain) // 2] if plain else float("nan")


def campaign_main(args, data, warm, low, plan_dict, rollout_dict, warm_steps) -> None:
    from experiments.data import Batches, shakespeare_tokens
    held_data = Batches(shakespeare_tokens(2_000_000), 16, 128, seed=99)
    held = [held_data.next() for _ in range(2)]

    def fresh(extra: dict | None, baseline=None):
        torch.manual_seed(0)
        model = build_gpt(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=128)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
        r = None if extra is None else parse_rollout({
            **rollout_dict, "thresholds": {**rollout_dict["thresholds"], **extra}, "baseline": {"losses": "in-memory"}})
        session = Session.build(model, opt, PrecisionPlan.from_dict(plan_dict), r, baseline=baseline)
        restore_warm(warm, model, opt, session, controller=r is not None)
        if r is not None:
            session.controller.loss_gap.ema = session.controller.loss_gap.base_ema = None
            session.events = []
            session.snapshots.kept.clear()
            session.snapshots.take(warm_steps)
        session.step_index = warm_steps
        data.load_state_dict(warm["data"])
        torch.set_rng_state(warm["rng"])
        return model, session

    model, session = fresh(None)
    with session.state.high_precision():
        base, base_eval, _ = run(model, session, data, END, held=held)
    session.close()
    print(f"# BF16 baseline from the warm state: loss {base[FAULT_AT]:.3f} at {FAULT_AT}, {base[END - 1]:.3f} at "
          f"{END - 1}")
    faults = campaign(low, args.drift_kinds.split(",") if args.drift_kinds else OTHER + PRECISION)
    if args.per_kind:
        faults = [f for f in faults if SEEDS[f.kind].index(f.seed) < args.per_kind]
    if args.seed_index:
        faults = [f for f in faults if SEEDS[f.kind].index(f.seed) in seed_positions(args.seed_index)]
    print("| # | fault | seed | site | judged at | blamed | decided by | windows | replay s | plain step s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for i, fault in enumerate(faults):
        model, session = fresh({"loss_gap": 1.0 if fault.eval_gate else LOSS_GAP["loss_gap"],
                                "loss_gap_smoothing": LOSS_GAP["loss_gap_smoothing"]}, baseline=base)
        ctl = session.controller   # the planted site's stage: a right blame is the site, or within its stage
        stage = {s for s, st in ctl.stage_of.items() if st == ctl.stage_of.get(fault.site)} | {fault.site}
        planted = PlantedDrift(fault, model, session.state, by_step=getattr(args, "onset_by_step", False))
        try:
            _, _, median = run(model, session, data, END, planted, held=held if fault.eval_gate else None,
                               base_eval=base_eval if fault.eval_gate else None)
        finally:
            planted.remove()
            session.close()
        ev = [e for e in session.events if e.step >= FAULT_AT]
        blamed = sorted({s for e in ev if e.kind in (EventKind.FALLBACK, EventKind.ROLLBACK) for s in e.sites})
        judged = session.window.judged
        ok = (fault.site in blamed and set(blamed) <= stage) if fault.precision else not blamed
        cost = sum(j.seconds for j in judged)
        rows.append((fault, ok, judged, cost, median, blamed))
        by = sorted({j.decided_by + (" (precision)" if j.precision_to_blame else "") for j in judged})
        if any(e.kind == EventKind.FALLBACK and e.reason.startswith("site thresholds") for e in ev):
            by.append("statistics")   # the site's own thresholds, not the window
        if any(e.kind == EventKind.REPLAY for e in ev):
            by.append("per-step replay")   # a spike: the step's own replays
        by = ", ".join(by)
        spikes = sorted({e.kind for e in ev if e.kind in (EventKind.SKIP_STEP, EventKind.REWIND)})
        print(f"| {i} | {fault.kind} | {fault.seed} | {fault.site or '-'} | "
              f"{', '.join(str(j.steps[1]) for j in judged) or '-'} | {', '.join(blamed) or '-'} | "
              f"{by or '-'}{' + ' + ', '.join(spikes) if spikes else ''} | {sum(j.windows for j in judged)} | "
              f"{cost:.1f} | {median:.2f} |", flush=True)
        if getattr(args, "drift_events", False):
            for e in ev:
                print(f"    {e.step} {e.kind} {','.join(e.sites) or '-'}: {e.reason}")
    prec = [r for r in rows if r[0].precision]
    other = [r for r in rows if not r[0].precision]
    judgments = [j for r in rows for j in r[2]]
    print()
    print(f"precision drift faults that demoted the planted site (alone or within its stage): "
          f"{sum(r[1] for r in prec)}/{len(prec)}")
    print(f"non-precision drift faults that demoted nothing: {sum(r[1] for r in other)}/{len(other)}")
    if judgments:
        print(f"suspicions judged: {len(judgments)}; by the first look alone: "
              f"{sum(j.decided_by == 'first_look' for j in judgments)}; windows trained again: "
              f"{sum(j.windows for j in judgments)} ({sum(j.retrained_steps for j in judgments)} steps); "
              f"{sum(j.seconds for j in judgments) / len(judgments):.1f} s per suspicion "
              f"(not precision: {_mean([j.seconds for j in judgments if not j.precision_to_blame]):.1f} s, "
              f"{_mean([j.windows for j in judgments if not j.precision_to_blame]):.1f} windows; precision: "
              f"{_mean([j.seconds for j in judgments if j.precision_to_blame]):.1f} s, "
              f"{_mean([j.windows for j in judgments if j.precision_to_blame]):.1f} windows); "
              f"a plain step {_mean([r[4] for r in rows]):.2f} s")


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


__all__ = ["Drift", "PlantedDrift", "campaign", "campaign_main"]
