"""A short fine-tune of SmolLM2-135M on Shakespeare with a staged precision rollout.

    python -m experiments.pretrained finetune [--steps 32] [--baseline] [--config experiments/configs/smollm2_rollout.yaml]

The config is a training config like experiments/configs/default.yaml: `model:` (the
factory experiments.smollm2:load_model), `train:` (lowprec.config.TrainConfig),
`finetune:` (FinetuneSettings: sequence length, held-out batches), `precision:` and
`rollout:`. The loop is a user's loop with `lowprec.runtime.Session`: forward and
backward, `session.step(loss, closure)` (which clips, decides, steps or skips, and keeps the
warmup schedule). The config turns rewinds off (a 135M model's snapshots cost 1.6 GB). The text is the Shakespeare training
split of experiments.data, tokenized with SmolLM2's own tokenizer; the held-out loss
is measured on the held-out plays before and after, in the final precision map and with
the same weights in high precision.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml
import torch.nn.functional as F
from torch import nn

from experiments import smollm2
from experiments.data import Batches, split_texts
from lowprec.config import TrainConfig
from lowprec.base.parse import parse as parse_section
from lowprec.runtime.engines.engine import forward_backward

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2_rollout.yaml"
_KEYS = ("model", "train", "finetune", "precision", "rollout")


@dataclass(frozen=True)
class FinetuneSettings:
    seq_len: int = 64        # tokens per sequence
    eval_batches: int = 4    # held-out batches (of train.batch_size sequences) before and after
    max_train_bytes: int | None = 300_000   # of the Shakespeare training split
    loss_gap: float = 0.02   # the controller's loss-gap threshold when a baseline curve is given

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.eval_batches < 0:
            raise ValueError(f"finetune.seq_len must be >= 2 (got {self.seq_len}) and finetune.eval_batches "
                             f">= 0 (got {self.eval_batches})")


@dataclass
class FinetuneResult:
    losses: list[float] = field(default_factory=list)
    events: list = field(default_factory=list)
    skipped_steps: int = 0
    seconds_per_step: float = 0.0
    heldout_before: float = float("nan")
    heldout_after: float = float("nan")            # in the final precision map
    heldout_after_hp: float = float("nan")         # the same weights in high precision
    flops_share: dict[str, float] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)


class CausalLMLoss(nn.Module):
    """`(logits, loss) = module(x, y)`, the shape lowprec.runtime.engines.engine.forward_backward expects."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm(input_ids=x, use_cache=False).logits
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def shakespeare_tokens(tokenizer, max_bytes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, held-out) token streams: the first max_bytes of each split, SmolLM2-tokenized."""
    def tokens(files: list[Path], limit: int | None) -> torch.Tensor:
        text = b"\n".join(f.read_bytes() for f in files)[:limit].decode("utf-8", errors="ignore")
        return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)

    train_files, held_files = split_texts()
    return tokens(train_files, max_bytes), tokens(held_files, None if max_bytes is None else max_bytes // 4)


def load_lm_with_loss(dtype: str = "float32") -> CausalLMLoss:
    """SmolLM2 wrapped so that `model(x, y)` returns `(logits, loss)`: the `model.factory` that
    `lowprec run` and `lowprec profile` need (experiments/configs/smollm2_profile.yaml). Its
    sites are `lm.model.layers.N....` and `lm.lm_head`."""
    return CausalLMLoss(smollm2.load_model(dtype))


def shakespeare_token_stream(max_bytes: int | None = 300_000) -> torch.Tensor:
    """The training split's first max_bytes, SmolLM2-tokenized, as one 1-D token tensor: the
    `data.factory` of experiments/configs/smollm2_profile.yaml (with `data.block_size`)."""
    return shakespeare_tokens(smollm2.load_tokenizer(), max_bytes)[0]


@torch.no_grad()
def mean_loss(model: CausalLMLoss, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    if not batches:
        return float("nan")
    was = model.training
    model.eval()
    try:
        return sum(float(model(x, y)[1]) for x, y in batches) / len(batches)
    finally:
        model.train(was)


def parse(cfg: dict) -> tuple[TrainConfig, FinetuneSettings]:
    unknown = sorted(set(cfg) - set(_KEYS))
    if unknown or "precision" not in cfg or "rollout" not in cfg:
        raise ValueError(f"a fine-tune config has the sections {', '.join(_KEYS)} (precision and rollout "
                         f"required); found {', '.join(map(str, cfg))}. See {DEFAULT_CONFIG.name}")
    return (parse_section(TrainConfig, cfg.get("train") or {}, "train"),
            parse_section(FinetuneSettings, cfg.get("finetune") or {}, "finetune"))


def finetune(cfg: dict, out_dir: str | Path, *, steps: int | None = None, controller: bool = True,
             baseline: dict[int, float] | None = None, log: Callable[[str], None] = print) -> FinetuneResult:
    """Fine-tune as `cfg` says; events go to out_dir/events.jsonl and, as they happen, to `log`.
    `baseline` ({step: loss}, e.g. the same run in BF16) turns the controller's loss-gap check on."""
    from lowprec import prepare
    from lowprec.sites.plan import PrecisionPlan
    from lowprec.policy.rollout import build_controller, parse_rollout
    from lowprec.runtime.trainer.loop import warmup_schedule
    from lowprec.runtime.session.session import Session, SessionSettings

    tc, fs = parse(cfg)
    n_steps = tc.steps if steps is None else steps
    smollm2.require()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tc.seed)
    t0 = time.perf_counter()
    lm, tokenizer = smollm2.load_model(), smollm2.load_tokenizer()
    train_tokens, held_tokens = shakespeare_tokens(tokenizer, fs.max_train_bytes)
    log(f"loaded the model in {time.perf_counter() - t0:.0f} s; {len(train_tokens)} training tokens, "
        f"{len(held_tokens)} held-out tokens")
    state = prepare(lm, PrecisionPlan.from_dict(cfg["precision"]), seed=tc.seed)
    model = CausalLMLoss(lm).train()
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    data = Batches(train_tokens, tc.batch_size, fs.seq_len, seed=tc.seed)
    held = Batches(held_tokens, tc.batch_size, fs.seq_len, seed=tc.seed + 1)
    held_batches = [held.batch(i) for i in range(fs.eval_batches)]
    ctl = None
    if controller:
        rollout = dict(cfg["rollout"])
        if baseline is not None:   # the loss gap to the same steps in BF16, from a file the config names
            curve = out / "baseline_losses.json"
            curve.write_text(json.dumps([baseline[i] for i in sorted(baseline)]))
            rollout["baseline"] = {"losses": str(curve)}
            rollout["thresholds"] = {**(rollout.get("thresholds") or {}), "loss_gap": fs.loss_gap}
        ctl = build_controller(parse_rollout(rollout), state, lm, baseline=baseline)
    sched = warmup_schedule(opt, tc.warmup)
    session = Session(model, opt, state, ctl, scheduler=sched,
                      settings=SessionSettings(max_grad_norm=tc.grad_clip),
                      event_log=out / "events.jsonl" if ctl is not None else None,
                      on_events=lambda evs: [log("  event " + e.summary()) for e in evs])
    res = FinetuneResult()
    state.collect_stats(False)
    res.heldout_before = mean_loss(model, held_batches)
    log(f"held-out loss before: {res.heldout_before:.4f} ({fs.eval_batches} batches of "
        f"{tc.batch_size} x {fs.seq_len} tokens)")
    session.resume_statistics()
    t_loop = time.perf_counter()
    for step in range(n_steps):   # a user's loop: forward, backward, session.step
        t_step = time.perf_counter()
        lr = opt.param_groups[0]["lr"]
        x, y = data.next()
        loss = forward_backward(model, x, y)
        result = session.step(loss, lambda: forward_backward(model, x, y))
        res.skipped_steps += not result.applied
        res.losses.append(float(loss))
        share = ", ".join(f"{k} {v:.0%}" for k, v in sorted(state.flops_share().items()))
        log(f"step {step:3d}  loss {res.losses[-1]:.4f}  grad norm {float(result.grad_norm):.3f}  lr {lr:.2e}  "
            f"{time.perf_counter() - t_step:.1f} s  [{share}]")
    res.seconds_per_step = (time.perf_counter() - t_loop) / max(n_steps, 1)
    state.collect_stats(False)
    res.heldout_after = mean_loss(model, held_batches)
    with state.high_precision():
        res.heldout_after_hp = mean_loss(model, held_batches)
    res.flops_share, res.formats = state.flops_share(), state.formats()
    res.events = list(session.events)
    return res


def step_times(formats: tuple[str, ...] = ("bf16", "fp8_tensorwise", "nvfp4"), *, batch_size: int = 2,
               seq_len: int = 64, reps: int = 3, log: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """Seconds per training step (forward, backward, AdamW) with every site of the FP8 plan in each
    format, without and with quantizer statistics (the monitors collect them on check steps only).
    The formats are interleaved rep by rep, and the minimum is kept, so that a busy machine
    disturbs the comparison as little as it can."""
    from lowprec import prepare
    from lowprec.sites.plan import PrecisionPlan

    smollm2.require()
    lm = smollm2.load_model()
    state = prepare(lm, PrecisionPlan.from_yaml(Path(__file__).resolve().parent / "configs" / "smollm2_fp8.yaml"))
    model = CausalLMLoss(lm).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, lm.config.vocab_size, (batch_size, seq_len + 1), generator=g)
    best: dict[str, dict[str, float]] = {f: {} for f in formats}
    for rep in range(reps + 1):                     # rep 0 warms up
        for fmt in formats:
            state.set_format(list(state.sites), fmt)
            for stats in (False, True):
                state.collect_stats(stats)
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                forward_backward(model, x[:, :-1], x[:, 1:])
                opt.step()
                dt = time.perf_counter() - t
                key = "with statistics" if stats else "without statistics"
                if rep:
                    best[fmt][key] = min(best[fmt].get(key, dt), dt)
    for fmt, row in best.items():
        log(f"{fmt:16s} " + "  ".join(f"{k}: {v:.2f} s" for k, v in row.items()))
    return best


def _summary_row(name: str, res: FinetuneResult) -> str:
    head, tail = res.losses[:4], res.losses[-4:]
    return (f"| {name} | {len(res.losses)} | {sum(head) / max(len(head), 1):.4f} | {sum(tail) / max(len(tail), 1):.4f} | "
            f"{res.heldout_before:.4f} | {res.heldout_after:.4f} | {res.heldout_after_hp:.4f} | "
            f"{res.seconds_per_step:.1f} | {len(res.events)} | {res.skipped_steps} |")


def main_finetune(config: str | Path, out: str | Path, steps: int | None, controller: bool,
                  with_baseline: bool = False) -> FinetuneResult:
    """The fine-tune, printed; with_baseline first runs the same steps with the plan's starting
    formats and no controller (BF16 here), and gives the rollout that loss curve to watch."""
    cfg, rows = yaml.safe_load(Path(config).read_text()), []
    base = None
    if with_baseline:
        print("baseline: the same fine-tune with the plan's starting formats, no controller", flush=True)
        base = finetune(cfg, Path(out) / "baseline", steps=steps, controller=False)
        rows.append(_summary_row("baseline (no controller)", base))
    res = finetune(cfg, Path(out) / ("rollout" if controller else "no_controller"), steps=steps,
                   controller=controller, baseline=dict(enumerate(base.losses)) if base is not None else None)
    rows.append(_summary_row("rollout" if controller else "no controller", res))
    print()
    print("| run | steps | loss, first 4 steps (mean) | loss, last 4 steps (mean) | held-out before | held-out after "
          "(as run) | held-out after (high precision) | s/step | events | skipped steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("GEMM FLOPs by format at the end (switchable layers): "
          + ", ".join(f"{k} {v:.0%}" for k, v in sorted(res.flops_share.items())))
    for e in res.events:
        print("  " + e.summary())
    if base is not None:
        gaps = [(a - b) / b for a, b in zip(res.losses, base.losses)]
        print("loss relative to the baseline, step by step (same batches): "
              + " ".join(f"{g:+.1%}" for g in gaps))
    return res
