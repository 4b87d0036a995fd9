"""Benchmark (issue 29, step 3): a whole Llama-style training step, BF16 against FP8.

One training step of `experiments.model.Llama` (FP32 master weights, BF16 autocast on CUDA,
as the GPU main job runs it): forward, cross-entropy, backward, AdamW (fused on CUDA). Rows,
one run, same initial weights and batch:

* `bf16`: the baseline (every Linear in BF16 under autocast);
* `lowprec <format>`: every Linear of the blocks a `PrecisionLinear` on the `torch` backend
  (the FP8 fast path), statistics on one step in ten (`check_every: 10`); the head stays BF16;
* `lowprec <format>, casts opaque` (with `--opaque-casts`): the same, with the casts kept opaque
  ops in the compiled blocks, as they were compiled before 2026-11-27;
* `torchao Float8Linear <recipe>`: torchao's float8 training on the same Linears (skipped with
  the reason where torchao is missing).

Each block is compiled on its own (`torch.compile(block)`, as torchtitan does), so that the
blocks share one compilation. Tokens/s is the median over `--steps` timed steps after
`--warmup` (CUDA-synchronised wall clock); each row is printed as it is measured.

    python experiments/bench_model_step.py                      # ~1B parameters (d 2048, 20 layers)
    python experiments/bench_model_step.py --device cpu --tiny  # a smoke run

`--json PATH` rewrites every row to PATH as it is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from experiments.model import Llama
from lowprec.numerics.formats import get_format
from lowprec.numerics.fp8_ops import opaque_in_graphs
from lowprec.sites.backends import get_backend
from lowprec.sites.layers import PrecisionLinear

CHECK_EVERY = 10


def block_linears(model: Llama):
    for block in model.blocks:
        for group in (block.attn, block.mlp):
            for name, mod in list(group.items()):
                if isinstance(mod, nn.Linear):
                    yield group, name, mod


def to_lowprec(model: Llama, fmt: str, fused: bool) -> list[PrecisionLinear]:
    backend, sites = get_backend("torch"), []
    for group, name, lin in block_linears(model):
        site = PrecisionLinear.from_module(lin, get_format(fmt), backend, fused=fused)
        group[name] = site
        sites.append(site)
    return sites


def to_torchao(model: Llama, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    for block in model.blocks:
        convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(recipe))


def measure(model: Llama, sites: list, batch, args, cuda: bool) -> float:
    """Median seconds of one training step."""
    if args.compile:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x, y = batch
    times = []
    for i in range(args.warmup + args.steps):
        for s in sites:
            s.collect_stats = i % CHECK_EVERY == 0
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if not torch.isfinite(loss):
        raise RuntimeError(f"loss is {loss.item()}")
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="d 64, 2 layers, 64 tokens")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hidden", type=int, default=5632)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--formats", nargs="*", default=["fp8_tensorwise"])
    p.add_argument("--torchao", nargs="*", default=["tensorwise"])
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--opaque-casts", action="store_true",
                   help="also a lowprec row per format with the casts kept opaque ops in the compiled blocks "
                        "(lowprec.numerics.fp8_ops.opaque_in_graphs: how they compiled before 2026-11-27)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU here; use --device cpu --tiny")
    if args.tiny:
        args.d_model, args.layers, args.heads, args.hidden, args.seq, args.batch = 64, 2, 4, 128, 32, 2
    torch.manual_seed(0)
    ref = Llama(block_size=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                hidden=args.hidden).to(args.device)
    n_params = sum(t.numel() for t in ref.parameters())
    x = torch.randint(0, 256, (args.batch, args.seq), device=args.device)
    y = torch.randint(0, 256, (args.batch, args.seq), device=args.device)
    tokens = args.batch * args.seq
    name = torch.cuda.get_device_name() if cuda else "cpu"
    record = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), "device": name,
              "torch": torch.__version__, "params": n_params, "tokens_per_step": tokens, "rows": []}
    print(f"# command: {record['command']}\n# device: {name}; torch {torch.__version__}; "
          f"{n_params / 1e6:.0f}M parameters, {tokens} tokens a step, compile {args.compile}")
    print("| variant | step ms | tokens/s | x bf16 | note |\n|---|---|---|---|---|", flush=True)
    variants = [("bf16", None)] + [(f"lowprec {f}", ("lowprec", f)) for f in args.formats]
    if args.opaque_casts:
        variants += [(f"lowprec {f}, casts opaque", ("lowprec-opaque", f)) for f in args.formats]
    variants += [(f"torchao Float8Linear {r}", ("torchao", r)) for r in args.torchao]
    base_s = None
    for label, how in variants:
        model, sites, note = copy.deepcopy(ref), [], ""
        try:
            if how and how[0].startswith("lowprec"):
                sites = to_lowprec(model, how[1], fused=True)
            elif how and how[0] == "torchao":
                if not cuda:
                    raise RuntimeError("torchao's float8 training needs a CUDA GPU")
                to_torchao(model, how[1])
            opaque = how is not None and how[0] == "lowprec-opaque"
            with opaque_in_graphs() if opaque else contextlib.nullcontext():   # every (re)compilation
                s = measure(model, sites, (x, y), args, cuda)
        except Exception as e:  # report, keep measuring the others
            s, note = float("nan"), f"FAILED {type(e).__name__}: {str(e)[:120]}"
        if label == "bf16":
            base_s = s
        ok = s == s
        speed = base_s / s if ok and base_s else None
        print(f"| {label} | {s * 1e3:.1f} | {tokens / s:,.0f} | {speed:.2f} | {note} |" if ok
              else f"| {label} | n/a | n/a | | {note} |", flush=True)
        record["rows"].append({"variant": label, "step_s": s if ok else None,
                               "tokens_per_s": tokens / s if ok else None, "speedup_vs_bf16": speed, "note": note})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        del model
        if cuda:
            torch.cuda.empty_cache()
    return record


if __name__ == "__main__":
    main()
