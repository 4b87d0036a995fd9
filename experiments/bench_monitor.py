"""Benchmark: the monitors' overhead per training step, as a ratio to the same step without.

The small GPT with every block's linear layers in FP8 (emulated) trains on Shakespeare
twice, alternating in chunks so that machine noise hits both alike: once plain (no
statistics, no monitor), once with a Session at the given `check_every`
(statistics on check steps, the per-step NaN guard, one collective and one host read
per check). Prints the mean time per step of each and the overhead, in wall-clock time
and in this process's CPU time (all threads): on a shared machine the CPU time is the
steadier of the two, since other jobs' load stretches wall-clock time but not the work
done here.

    python -m experiments.bench_monitor --steps 200 --check-every 10
"""

from __future__ import annotations

import argparse
import time

import torch

from experiments.data import Batches, split_texts, tokens_of
from experiments.model import build_gpt
from lowprec import prepare
from lowprec.sites.plan import PrecisionPlan
from lowprec.policy.rollout import build_controller, parse_rollout
from lowprec.runtime import Session, SessionSettings

PLAN = {"backend": "emulated", "keep_high_precision": [{"fqns": ["lm_head"]}],
        "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise"}]}


def build(check_every: int, monitored: bool, args):
    torch.manual_seed(0)
    model = build_gpt(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=4,
                      d_model=args.d_model)
    state = prepare(model, PrecisionPlan.from_dict({**PLAN, "fused": args.fused}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = None
    if monitored:
        rollout = {"check_every": check_every, "min_steps": 10**9,
                   "stages": [{"name": "s", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise"}]}
        spec = parse_rollout(rollout)
        session = Session(model, opt, state, build_controller(spec, state, model),
                          settings=SessionSettings(monitor=spec.monitor_config(), max_grad_norm=1.0))
    else:
        state.collect_stats(False)
    return model, opt, session


def run(model, opt, session, data, start: int, n: int) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process) for steps start .. start + n - 1."""
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(start, start + n):
        x, y = data.batch(step)

        def closure():
            _, loss = model(x, y)
            loss.backward()
            return loss
        loss = closure()
        if session is not None:
            session.step(loss, closure)  # clip, decide, step (or skip), zero the grads
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--check-every", type=int, default=10)
    p.add_argument("--chunk", type=int, default=20)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--fused", action="store_true")
    args = p.parse_args(argv)
    data = Batches(tokens_of(split_texts()[0], 1_000_000), args.batch_size, args.block_size)
    plain = build(args.check_every, False, args)
    mon = build(args.check_every, True, args)
    for m in (plain, mon):  # warm-up (and compile, when fused)
        run(*m, data, 0, args.chunk)
    t_plain = t_mon = c_plain = c_mon = 0.0
    for start in range(args.chunk, args.chunk + args.steps, args.chunk):
        t, c = run(*plain, data, start, args.chunk)
        t_plain, c_plain = t_plain + t, c_plain + c
        t, c = run(*mon, data, start, args.chunk)
        t_mon, c_mon = t_mon + t, c_mon + c
    n = args.steps
    print(f"# {args.n_layer} layers, d_model {args.d_model}, {args.batch_size}x{args.block_size} tokens, "
          f"fp8_tensorwise emulated{' fused' if args.fused else ''}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {n} steps each, alternating chunks of {args.chunk}")
    print("| variant | ms/step | ratio | CPU ms/step | CPU ratio |")
    print("|---|---|---|---|---|")
    print(f"| no monitor | {t_plain / n * 1e3:.1f} | 1.000 | {c_plain / n * 1e3:.1f} | 1.000 |")
    print(f"| monitor, check_every={args.check_every} | {t_mon / n * 1e3:.1f} | {t_mon / t_plain:.3f} | "
          f"{c_mon / n * 1e3:.1f} | {c_mon / c_plain:.3f} |")


if __name__ == "__main__":
    main()
