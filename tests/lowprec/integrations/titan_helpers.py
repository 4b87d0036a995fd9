"""torchtitan's real Trainer under torchrun on the CPU, for the integration tests.

`TitanJob(tmp)` writes what a torchtitan job reads (a byte-level tokenizer in the format
torchtitan's `HuggingFaceTokenizer` loads, real text as the JSONL files its Hugging Face text
data loader reads from a local path, the lowprec YAML and a config-registry module) and runs
`torchrun --nproc-per-node N titan_launch.py --module lowprec_job --config debugmodel_lowprec`.
Each rank writes what its rollout ended with (formats, events, lowprec's step, skips, the
losses, whether it resumed lowprec's state, its evals) to `dump/lowprec_rank<R>.json`. With
`kill_at` set, each rank writes it when torchtitan's step `kill_at` begins (the rollout as the
checkpoint before holds it), and rank 0, once that step is trained and its tracking sent,
SIGKILLs itself: a job that dies mid-run, for torchtitan to resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

# what a rank imports before it reads the job (titan_launch.py, the job module): once in the rank server
# (titan_launch.py's `main` makes the same changes again: each sees it was made and does nothing)
TITAN_IMPORTS = tuple(f"lowprec.integrations.torchtitan_launch:{change}"
                      for change in ("run_on_cpu", "keep_timeouts", "adapt_pipeline_schedules")) + (
    "torchtitan.train", "torchtitan.models.llama3", "torchtitan.models.qwen3", "lowprec.integrations.torchtitan")

# the config-registry module: the lines a user writes, the CPU settings, and the test's own parts
JOB = '''\
import dataclasses
import json
import os
import signal
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from lowprec.integrations.torchtitan import LowprecConverter, LowprecTrainer, lowprec_trainer
from lowprec.runtime.trainer.faults import Faults, Injection

SETTINGS = json.loads({settings!r})


def debugmodel_lowprec():
    config = llama3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=[
        LowprecConverter.Config(config=SETTINGS["plan"], event_log=SETTINGS["events"],
                                fp8_all_gather=SETTINGS["fp8_all_gather"])])
    # this CPU run: SDPA attention (FlexAttention has no CPU backward); FSDP reduces with SUM
    # (gloo has no PREMUL_SUM); local tokenizer and data; small and short
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=_sum_reduction(
        config.model_spec.parallelize_fn), post_optimizer_build_fn=_faults)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    config.hf_assets_path = SETTINGS["tokenizer"]
    config.dataloader.dataset_path = SETTINGS["data"]
    config.training.seq_len, config.training.local_batch_size = 64, 2
    config.training.steps = SETTINGS["steps"]
    config.training.mixed_precision_param = SETTINGS["param_dtype"]
    config.validator.enable = SETTINGS["validator"]   # its first batch: the LR probe's held batch
    config.validator.freq = 1000
    config.validator.dataloader.dataset, config.validator.dataloader.dataset_path = "c4_test", SETTINGS["validation"]
    config.activation_checkpoint = None   # the fault's site keeps its name (no checkpoint wrapper)
    config.debug.seed = 0
    config.checkpoint.enable, config.checkpoint.interval = True, SETTINGS["checkpoint_every"]
    config.dump_folder = SETTINGS["dump"]
    return _recording(lowprec_trainer(config))


def _sum_reduction(parallelize):
    def fn(model, **kwargs):
        model = parallelize(model, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model
    return fn


def _faults(optimizers, model_parts, parallel_dims):
    """The injected faults of this rank (a fault's rank -1: every rank), in whichever of its model
    parts (pipeline stages) holds the site; a loss spike on the part that ends in the model's head.
    They tick once per optimizer step."""
    rank = torch.distributed.get_rank()
    mine = [Injection(**{{k: v for k, v in f.items() if k != "rank"}}) for f in SETTINGS["faults"]
            if f["rank"] in (-1, rank)]
    if not mine:
        return
    for part in model_parts:
        faults = Faults(part, mine, root=getattr(part, "lm_head", None) is not None)
        optimizers.register_step_post_hook(lambda *a, faults=faults: faults.tick(faults.iteration + 1))


class RecordingTrainer(LowprecTrainer):
    """LowprecTrainer that writes what each rank's rollout ended with, and under FP8 all-gather
    what each site's forwards were handed."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(LowprecTrainer.Config):
        pass

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gathers = {{}}   # site -> [FP8 bytes while FP8, high precision while not, a mismatch]
        self.sent = {{}}      # site -> {{"fp8"|"hp": [gathers, bytes this rank sent, elements of its shard]}}
        if SETTINGS["fp8_all_gather"]:
            for fqn, site in self.hosted.state.sites.items():
                site.module.register_forward_pre_hook(lambda m, a, fqn=fqn: self._count(fqn, m))
            self._count_sent()

    def _count_sent(self):
        """The bytes this rank sends into each site's all-gathers, by what they carry: FSDP2 sends
        what `fsdp_pre_all_gather` returns, and a high-precision gather the rest of the bytes in
        its second all-gather (the metadata's tensor)."""
        from lowprec.sites.fp8_allgather import FP8AllGatherWeight
        pre, sent = FP8AllGatherWeight.fsdp_pre_all_gather, self.sent

        def counted(weight, mesh, outer_size, outer_stride, module, mp_policy):   # FSDP2 checks the signature
            (data,), meta = out = pre(weight, mesh, outer_size, outer_stride, module, mp_policy)
            row = sent.setdefault(weight._site.fqn, {{}}).setdefault(meta[0], [0, 0, 0])
            row[0] += 1
            row[1] += data.numel() * data.element_size() + (meta[1].numel() if meta[0] == "hp" else 0)
            row[2] += weight._tensor.numel()
            return out
        FP8AllGatherWeight.fsdp_pre_all_gather = counted

    def _count(self, fqn, module):
        from lowprec.sites.fp8_allgather import gathers_fp8
        w = module.weight
        got = getattr(w.to_local() if hasattr(w, "to_local") else w, "fp8", None)
        want = gathers_fp8(module)
        row = self.gathers.setdefault(fqn, [0, 0, 0])
        row[2 if got is not want else 0 if want else 1] += 1

    def _check_gathers(self):
        """Each site's weight as FSDP2 gathers it now (its unit unsharded) against the whole
        weight (`full_tensor`): FP8 bytes one process's cast of it, else its bf16 values, bit for bit."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
        from lowprec.numerics.formats import QuantSpec, Scaling
        from lowprec.numerics.fp8_ops import ELEMENTS
        from lowprec.numerics.quantize import quantize
        from lowprec.sites.fp8_allgather import gathers_fp8
        out = {{}}
        units = {{n: m for m in self.model_parts for n, m in m.named_modules() if isinstance(m, FSDPModule)}}
        for fqn, site in self.hosted.state.sites.items():
            m = site.module
            whole = m.weight.full_tensor()
            unit = units[max((n for n in units if fqn.startswith(n)), key=len)]
            unit.unshard()
            w = m.weight   # under TP a tp DTensor of the gathered tp shard: compared whole
            got = w.to_local() if hasattr(w, "to_local") else w
            whole_of = (lambda t: DTensor.from_local(t, w.device_mesh, w.placements).full_tensor()) \
                if isinstance(w, DTensor) else (lambda t: t)
            if gathers_fp8(m):
                spec = QuantSpec(ELEMENTS[m._fast[0].fwd], Scaling.TENSOR)
                amax = torch.where(torch.isfinite(whole), whole.abs(), 0.0).amax()
                want = quantize(whole, spec, amax=amax, validate=False).to_storage().view(torch.uint8)
                out[fqn] = ["fp8", bool(got.fp8 and torch.equal(whole_of(got.forms().q.view(torch.uint8)), want))]
            else:
                hp = got.materialize() if hasattr(got, "materialize") else got
                out[fqn] = ["hp", bool(not getattr(got, "fp8", False) and torch.equal(whole_of(hp), whole.to(hp.dtype)))]
            unit.reshard()
        return out

    def train_step(self, data_iterator):
        kill = self.step == SETTINGS["kill_at"]
        if kill:
            self.gather_check = self._check_gathers() if SETTINGS["fp8_all_gather"] else None
            self._report(self.step - 1)   # torchtitan counts the step that begins
        super().train_step(data_iterator)
        if kill and torch.distributed.get_rank() == 0:   # the step the resumed job trains again
            h = self.hosted
            Path(SETTINGS["dump"], "killed_step.json").write_text(json.dumps(
                {{"step": h.step, "loss": h.losses[-1], "grad_norm": h.after.record.grad_norms[-1]}}))
            self.hosted.tracker.flush(60)   # the step's points are in the run: a resume must not log them again
            os.kill(os.getpid(), signal.SIGKILL)

    def train(self):
        super().train()
        self.gather_check = self._check_gathers() if SETTINGS["fp8_all_gather"] else None
        self._report(self.step, self._without_controller() if self.hosted.whole is not None else None)
        if SETTINGS["reference"]:   # after the report: its eval forward routes tokens of its own
            self._against_one_process()

    def _report(self, titan_step, without_controller=None):
        h = self.hosted
        rank = torch.distributed.get_rank()
        out = {{"rank": rank, "formats": h.formats(), "local": sorted(h.state.sites), "step": h.step,
               "titan_step": titan_step,
               "skipped": h.session.skipped, "rewinds": h.session.rewinds, "restored": self.restored,
               "losses": h.losses, "events": [e.to_json() for e in h.session.events],
               "evals": h.evals.history if h.evals is not None else None, "without_controller": without_controller,
               "gathers": self.gathers, "gather_check": getattr(self, "gather_check", None), "sent": self.sent,
               "grad_norms": h.after.record.grad_norms}}
        Path(SETTINGS["dump"], f"lowprec_rank{{rank}}.json").write_text(json.dumps(out))

    def _without_controller(self):
        """Under pipeline stages, what a HostedRollout of this plan without its rollout section (and
        untracked) reports over this rank's stages as they are now (a collective: every rank builds one),
        and this rank's copy of the whole model's sites (the other stages' layers it does not run)."""
        from lowprec.integrations.core import HostedRollout
        h = self.hosted
        cfg = dataclasses.replace(h.config, rollout=None, eval=None,
                                  tracking=dataclasses.replace(h.config.tracking, enabled=False))
        plain = HostedRollout(cfg, h.model, state=h.state, whole=h.whole)
        plain.start(h.session.optimizer)
        return {{"formats": plain.formats(), "flops_share": plain.map.flops_share(),
                "whole_copy": h.whole.state.formats()}}

    def _against_one_process(self):
        """An eval forward's logits and (with an LR probe) its held loss, through this job's parallelism
        (every rank, the model parts in eval mode), and the same from the whole model in this process
        (every rank's parameters and sites' scaling state gathered, an expert's from the rank that runs
        it, the run's formats, the parameters in the dtype torchtitan's FSDP computes with), on the
        batch as the job ran it (under pipeline parallelism each micro-batch as the schedule ran it, in
        the same order): to dump/forwards_rank<R>.pt."""
        from torch.nn.functional import cross_entropy

        from lowprec.integrations.torchtitan import prepared_of
        from lowprec.integrations.torchtitan_forward import logits
        from lowprec.integrations.torchtitan_probe import _held_batch
        world = torch.distributed.get_world_size()
        parts, scaling = [None] * world, [None] * world
        torch.distributed.all_gather_object(parts, {{k: getattr(v, "full_tensor", v.detach)().detach()
                                                     for m in self.model_parts for k, v in m.state_dict().items()}})
        torch.distributed.all_gather_object(scaling, self._scaling_state_run_here())
        tokens = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))   # 3 rows of 40 tokens
        for m in self.model_parts:
            m.eval()
        probe = self.hosted.session.lr_probe
        with torch.no_grad():
            got, held = logits(self, tokens), probe.held_loss() if probe is not None else None
        whole = self.model_config.build()
        whole._lowprec_guard.remove()
        whole.init_weights(buffer_device=None)
        missing, _ = whole.load_state_dict({{k: v for p in parts for k, v in p.items()}}, strict=False)
        assert not [k for k in missing if k in dict(whole.named_parameters())], missing
        state = prepared_of(whole).state
        for fqn, fmt in self.hosted.formats().items():
            state.set_format(fqn, fmt)
        state.load_scaling_state({{k: v for s in scaling for k, v in s.items()}})
        param_dtype = getattr(torch, self.config.training.mixed_precision_param)
        for p in whole.parameters():   # FSDP computes with its parameters in mixed_precision_param (bf16)
            p.data = p.data.to(param_dtype)
        whole.eval()
        with torch.no_grad():
            if self.pp_mesh is None:   # the eval forward is the model's forward on the whole batch
                want = whole(tokens).float()
            else:                      # micro-batches of whole schedule steps, padded
                rows = self.config.training.local_batch_size // self.num_pipeline_parallel_microbatches
                steps = -(-3 // self.config.training.local_batch_size) * self.config.training.local_batch_size
                padded = torch.zeros((steps, self.config.training.seq_len), dtype=torch.long)
                padded[:3, :40] = tokens
                want = torch.cat([whole(x) for x in padded.split(rows)])[:3, :40].float()
            out = {{"logits": got, "logits_one_process": want}}
            if probe is not None:
                rows = self.config.training.local_batch_size // self.num_pipeline_parallel_microbatches
                input_dict, labels = _held_batch(self)
                ce = [cross_entropy(whole(x).flatten(0, 1).float(), t.flatten(), reduction="sum", ignore_index=-100)
                      for x, t in zip(input_dict["input"].split(rows), labels.split(rows))]
                out.update(held_loss=held.float(), held_loss_one_process=torch.stack(ce).sum() / (labels != -100).sum(),
                           probe=dataclasses.astuple(self.hosted.session.lr_probe_result))
        torch.save(out, Path(SETTINGS["dump"], f"forwards_rank{{torch.distributed.get_rank()}}.pt"))

    def _scaling_state_run_here(self):
        """This rank's sites' scaling state (`scaling_state()`), an expert's only where it runs
        (under expert parallelism the other ranks' copies of its site stay fresh: gathered last,
        they would replace the histories of the rank that runs it)."""
        here = {{id(s) for m in self.model_parts for e in m.modules() if hasattr(e, "_local_sites")
                for s in e._local_sites()}}
        sites = self.hosted.state.sites
        return {{fqn: v for fqn, v in self.hosted.state.scaling_state().items()
                if not hasattr(sites[fqn].module, "expert_index") or id(sites[fqn].module) in here}}


def _recording(config):
    return RecordingTrainer.Config(**{{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}})
'''


def write_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer without merges (one token per byte) plus BOS/EOS, saved as
    torchtitan's HuggingFaceTokenizer reads it (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": True, "add_eos_token": True}))
    return folder


def write_text_data(folder: Path, split: int = 0) -> Path:
    """A Shakespeare play, one paragraph per JSONL record ({"text": ...}), as the data loader's
    local path: the first training play (split 0) or the first held-out one (split 1)."""
    from lowprec.evals.corpora import clean_text, split_texts
    folder.mkdir(parents=True, exist_ok=True)
    text = clean_text(split_texts()[split][0].read_bytes())
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return folder


class TitanJob:
    """One torchtitan job folder: tokenizer, data, lowprec YAML, config module, dump folder."""

    def __init__(self, tmp: Path, plan: str, *, steps: int, checkpoint_every: int, faults=(), validator: bool = False,
                 kill_at: int = -1, reference: bool = False, fp8_all_gather: bool = False,
                 param_dtype: str = "bfloat16", job: str = JOB):
        """faults: `fault(...)`s; validator: torchtitan's validation data on (the LR probe's held batch);
        kill_at: torchtitan's step after which rank 0 SIGKILLs itself (-1: none); reference: after
        training, each rank writes an eval forward and the LR probe's held loss beside the whole
        model's in one process (`dump/forwards_rank<R>.pt`); job: the config module's template."""
        self.tmp, self.job = tmp, job
        self.dump = tmp / "dump"
        (tmp / "lowprec.yaml").write_text(plan)
        self.settings = {"plan": str(tmp / "lowprec.yaml"), "events": str(tmp / "events.jsonl"),
                         "tokenizer": str(write_tokenizer(tmp / "tokenizer")),
                         "data": str(write_text_data(tmp / "data")),
                         "validation": str(write_text_data(tmp / "validation", split=1)),
                         "steps": steps, "checkpoint_every": checkpoint_every, "dump": str(self.dump),
                         "faults": [dict(f) for f in faults], "validator": validator, "kill_at": kill_at,
                         "reference": reference, "fp8_all_gather": fp8_all_gather, "param_dtype": param_dtype}
        self._write()

    def _write(self) -> None:
        (self.tmp / "lowprec_job.py").write_text(self.job.format(settings=json.dumps(self.settings)))

    def update(self, plan: str | None = None, **settings) -> None:
        """New settings (and lowprec YAML) for the next run of the job."""
        if plan is not None:
            Path(self.settings["plan"]).write_text(plan)
        self.settings.update(settings)
        self._write()

    def run(self, forks, nproc: int, port: int, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
        """torchrun with `nproc` ranks, each forked by `forks` (the `rank_forks` fixture) from a server that
        imported torchtitan's trainer and lowprec once."""
        torchrun = Path(sys.executable).with_name("torchrun")
        env = forks.env({**os.environ, "PYTHONPATH": os.pathsep.join([str(self.tmp), str(REPO)]), "OMP_NUM_THREADS": "1",
                         "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, imports=TITAN_IMPORTS)
        cmd = [str(torchrun), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
               str(port), *forks.rank(HERE / "titan_launch.py", "--module", "lowprec_job", "--config",
                                      "debugmodel_lowprec", *extra)]
        return subprocess.run(cmd, cwd=self.tmp, env=env, capture_output=True, text=True, timeout=timeout)

    def reports(self, nproc: int) -> list[dict]:
        return [json.loads((self.dump / f"lowprec_rank{r}.json").read_text()) for r in range(nproc)]


def fault(kind: str, site: str, start: int, stop: int, factor: float = 1e4, rank: int = -1) -> dict:
    """An injection's fields (lowprec.runtime.trainer.faults.Injection) and the rank it is injected on
    (-1: every rank), as the job's settings carry them."""
    return {"kind": kind, "site": site, "start": start, "stop": stop, "factor": factor, "rank": rank}
