"""A golden trace of `lowprec run`'s loop: decisions, events and the loss curve of one seed.

Recorded before a change that must not change behaviour (issue 31 moves the after-step
logic and the config into one place each) and compared after, by
tests/lowprec/runtime/test_golden_trace.py. A small GPT on Shakespeare, the staged rollout
of tests/lowprec/runtime/test_loop_faults.py with a rewind on, a NaN injected into one site
(a fallback by replay) and a learning-rate spike (a skip and a rewind, nothing demoted).

Record it again (only when a change of behaviour is intended, and say so in the commit):

    python tests/lowprec/runtime/golden_trace.py          # replaces every recorded curve
    python tests/lowprec/runtime/golden_trace.py --add    # adds this CPU's curve, keeps the rest

The loss bits depend on which kernels ATen and oneDNN pick for the CPU (an AVX512 machine sums
a GEMM in another order than an AVX2 one: 1.8e-3 relative apart after 90 steps with a NaN and an
LR spike, same decisions), and ATen's capability alone does not decide it: two AVX512 machines (one
with AVX512-BF16, from another vendor) gave two curves. So the file keeps one curve per CPU
fingerprint (`cpu_fingerprint()`: the capability, the vendor and the ISA extensions oneDNN picks
kernels by).
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "loop_trace.json"
sys.path.insert(0, str(HERE.parents[2]))

SITE = "blocks.1.mlp.fc"
CONFIG = {
    "model": {"factory": "experiments.model:build_gpt",
              "args": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "d_model": 32}},
    "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 200_000}, "block_size": 32},
    "train": {"steps": 90, "batch_size": 8, "lr": 3e-3, "warmup": 10, "ckpt_every": 30, "seed": 0},
    "precision": {"backend": "emulated", "keep_high_precision": [{"fqns": ["lm_head"]}],
                  "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 10, "min_steps": 0, "cooldown_steps": 1000, "quarantine_after": 2,
                "rewind": {"enabled": True, "skip_batches": 3},
                "thresholds": {"max_saturated_frac": 1e-3, "site_patience": 2, "large_warmup": 20,
                               "spike_min_history": 20, "spike_window": 32},
                "stages": [{"name": "mlp_fp8", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_tensorwise"},
                           {"name": "attn_fp8", "select": {"glob": "blocks.*.attn.*"}, "format": "fp8_tensorwise"}]},
    "tracking": {"enabled": False},
}


# The CPU's reductions split by thread: the bits of a loss depend on the count. One thread: two
# would wait on each other whenever another process holds a core (a test worker beside this one),
# which made the same 90 steps take five times as long.
THREADS = 1


# ISA extensions beyond ATen's capability that change which GEMM kernels oneDNN takes
_KERNEL_FLAGS = ("avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile")


def cpu_fingerprint() -> str:
    """ATen's CPU capability, the vendor and the kernel-relevant ISA flags, e.g.
    'AVX512 AuthenticAMD avx512_bf16+avx512_vnni'; the capability alone where /proc/cpuinfo is absent."""
    import torch
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return capability
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return " ".join([capability, fields.get("vendor_id", "?"), "+".join(f for f in _KERNEL_FLAGS if f in flags) or "-"])


def trace(out_dir: Path) -> dict:
    """Run the config (on THREADS intra-op threads, as recorded) and return what the golden
    file holds."""
    import torch
    from lowprec.runtime import Injection
    from lowprec.runtime.trainer.run import run_config
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        res = run_config(copy.deepcopy(CONFIG), out_dir,
                         faults=[Injection("nan", 35, 200, SITE), Injection("lr_spike", 60, 63, factor=100.0)])
    finally:
        torch.set_num_threads(before)
    events = [{"step": e.step, "kind": str(e.kind), "sites": list(e.sites),
               "to_format": dict(e.to_format or {})} for e in res.events]
    return {"losses": [float(x).hex() for x in res.losses], "events": events,
            "formats": {str(k): v for k, v in sorted(res.formats.items())},
            "rewinds": res.rewinds, "skipped": res.skipped, "passes": res.passes}


def record(t: dict, keep_others: bool) -> dict:
    """The golden file's content: `t`'s events and counts, and its losses as this CPU's curve
    (beside the other CPUs' curves when `keep_others`; their events must be `t`'s)."""
    curves = {}
    if keep_others and GOLDEN.exists():
        old = json.loads(GOLDEN.read_text())
        if {k: v for k, v in old.items() if k != "losses_by_cpu"} != {k: v for k, v in t.items() if k != "losses"}:
            raise SystemExit("this CPU's decisions differ from the recorded ones: record all again, without --add")
        curves = old["losses_by_cpu"]
    curves[cpu_fingerprint()] = t["losses"]
    return {**{k: v for k, v in t.items() if k != "losses"}, "losses_by_cpu": curves}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        t = trace(Path(tmp))
    GOLDEN.write_text(json.dumps(record(t, "--add" in sys.argv[1:]), indent=1) + "\n")
    kinds = [e["kind"] for e in t["events"]]
    print(f"wrote {GOLDEN}: {len(t['losses'])} losses, events {sorted(set(kinds))}, rewinds {t['rewinds']}")
