"""A torchtitan job (config-registry module) training the four-hosts test's tiny Llama under torchtitan's Trainer.

`torchrun --nproc-per-node 1 titan_launch.py --module titan_tiny_llama --config tiny_llama_lowprec`,
run in a folder holding the job's settings, `titan_tiny_llama.json` (test_four_hosts writes it).
The model is the Hugging Face tiny Llama of llama_helpers (the same initial weights, module
names and logits) as a torchtitan model; the
data are the same batches in the same order, with labels shifted as the Hugging Face model
shifts them (torchtitan's summed cross-entropy over the global token count is then the same
mean loss); AdamW at a constant learning rate, clipped to norm 1; the overflow injected into
the same site at the same steps.
"""

import dataclasses
import json
from pathlib import Path

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from llama_helpers import shakespeare_blocks, tiny_llama
from lowprec.integrations.torchtitan import LowprecConverter, LowprecTrainer, lowprec_trainer
from lowprec.runtime.trainer.faults import Faults, Injection

SETTINGS = json.loads(Path("titan_tiny_llama.json").read_text())   # in the job's working folder


class TinyLlama(BaseModel):
    """llama_helpers.tiny_llama as a torchtitan model: its modules under their HF names, its logits."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        def update_from_config(self, *, config, **kwargs) -> None:
            pass

        def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
            n = sum(p.numel() for p in model.parameters())
            return n, 6 * n   # the usual 6N per token (torchtitan logs MFU from it)

    def __init__(self, config):
        super().__init__()
        hf = tiny_llama()
        self.model, self.lm_head = hf.model, hf.lm_head
        self._hf = (hf,)   # its forward, not a submodule

    def forward(self, tokens, **kwargs):
        return self._hf[0](input_ids=tokens).logits

    def verify_module_protocol(self) -> None:
        """The Hugging Face submodules are not torchtitan Modules (BaseModel's documented override)."""

    def init_weights(self, buffer_device=None) -> None:
        """The same initial weights as the other hosts' tiny_llama() (built on the meta device here)."""
        hf = tiny_llama()
        own = dict(self.named_parameters())
        with torch.no_grad():
            for name, p in hf.named_parameters():
                own[name].copy_(p)
            for name, b in hf.named_buffers():
                dict(self.named_buffers())[name].copy_(b)


class InOrder(BaseDataLoader):
    """The four hosts' batches, in order: ({"input": ids}, ids shifted left, IGNORE_INDEX last)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config, **kwargs):
        self.batch = kwargs["local_batch_size"]

    def __iter__(self):
        blocks = shakespeare_blocks(8 * SETTINGS["steps"])
        for i in range(0, len(blocks), self.batch):
            x = torch.stack([b["input_ids"] for b in blocks[i:i + self.batch]])
            labels = torch.full_like(x, IGNORE_INDEX)
            labels[:, :-1] = x[:, 1:]
            yield {"input": x}, labels

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict) -> None:
        pass


def _faults(optimizers, model_parts, parallel_dims):
    faults = Faults(model_parts[0], [Injection(**f) for f in SETTINGS["faults"]])
    optimizers.register_step_post_hook(lambda *a: faults.tick(faults.iteration + 1))


def tiny_llama_lowprec():
    model = LowprecConverter.Config(config=SETTINGS["plan"], event_log=SETTINGS["events"]).build().convert(
        TinyLlama.Config())
    spec = ModelSpec(name="tiny_llama", flavor="test", model=model, parallelize_fn=lambda m, **kw: m,
                     pipelining_fn=None, post_optimizer_build_fn=_faults, state_dict_adapter=None)
    adamw = ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={
        "lr": SETTINGS["lr"], "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01})
    config = Trainer.Config(model_spec=spec, hf_assets_path=SETTINGS["tokenizer"], dump_folder=SETTINGS["dump"],
                            loss=CrossEntropyLoss.Config(), dataloader=InOrder.Config(),
                            optimizer=OptimizersContainer.Config(param_groups=[adamw]),
                            lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0))
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 64, 8, SETTINGS["steps"]
    config.training.max_norm = 1.0
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.parallelism.spmd_backend = "partial_dtensor"
    config.activation_checkpoint = None
    config.validator.enable = False
    config.debug.seed = 0
    return _recording(lowprec_trainer(config))


class RecordingTrainer(LowprecTrainer):
    """LowprecTrainer that writes its events when training ends."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(LowprecTrainer.Config):
        pass

    def train(self):
        super().train()
        Path(SETTINGS["dump"], "events.json").write_text(json.dumps([e.to_json() for e in self.hosted.session.events]))


def _recording(config):
    return RecordingTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
