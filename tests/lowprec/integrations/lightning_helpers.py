"""A LightningModule around the tiny Llama, and one Lightning run with lowprec's callback that
several tests read: promotions, a NaN that is skipped, a loss spike that rewinds, MLflow."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import lightning
import torch
from torch.utils.data import DataLoader

from llama_helpers import CONFIG, optimizer_state, shakespeare_blocks, tiny_llama
from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection

NAN_SITE = "model.layers.0.mlp.down_proj"
NAN_AT, SPIKE_AT, STEPS = 30, 40, 50


class LlamaModule(lightning.LightningModule):
    """The tiny Llama trained with AdamW and a linear warmup stepped every optimizer step."""

    def __init__(self, lr: float = 3e-3, warmup: int = 5):
        super().__init__()
        self.model = tiny_llama()
        self.lr, self.warmup = lr, warmup

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def loader(n: int, batch_size: int = 8) -> DataLoader:
    return DataLoader(shakespeare_blocks(n), batch_size=batch_size, shuffle=False, num_workers=0)


def experiment(uri: str, name: str, tmp: Path) -> None:
    """Create the MLflow experiment `name` with its artifacts under `tmp` (not ./mlruns)."""
    from mlflow.tracking import MlflowClient
    MlflowClient(uri).create_experiment(name, artifact_location=(tmp / "artifacts").as_uri())


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


@dataclass
class Watch(lightning.pytorch.Callback):
    """Ticks the faults with Lightning's step (it never goes back) and keeps, around every
    optimizer step, what the tests compare: weights and optimizer state per lowprec step,
    and before/after pairs of the steps lowprec skipped or rewound."""
    lowprec: object
    faults: Faults
    at_step: dict = field(default_factory=dict)    # lowprec step -> (weights, optimizer state, scheduler
    #                                                steps), at its first visit
    skips: list = field(default_factory=list)      # (lightning step, before, after) of skipped steps
    rewinds: list = field(default_factory=list)    # (lowprec step gone back to, *what at_step keeps)
    losses: dict = field(default_factory=dict)     # lightning step -> the loss training_step returned

    def _keep(self, trainer, pl_module):
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        return params(pl_module), optimizer_state(trainer.optimizers[0]), scheduler.last_epoch

    def on_train_start(self, trainer, pl_module):
        self.at_step[self.lowprec.step] = self._keep(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.faults.tick(trainer.global_step)
        self._before = (self._keep(trainer, pl_module), self.lowprec.session.skipped, self.lowprec.session.rewinds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        before, skipped, rewinds = self._before
        now = self._keep(trainer, pl_module)
        self.losses[trainer.global_step - 1] = float(outputs["loss"])
        if self.lowprec.session.rewinds > rewinds:
            self.rewinds.append((self.lowprec.step, *now))
        elif self.lowprec.session.skipped > skipped:
            self.skips.append((trainer.global_step - 1, before, now))
        self.at_step.setdefault(self.lowprec.step, now)


@dataclass
class Run:
    callback: object
    watch: Watch
    trainer: lightning.Trainer
    module: LlamaModule
    tracking_uri: str


def train(tmp: Path, steps: int = STEPS, config: str = CONFIG) -> Run:
    """The tiny Llama for `steps` Lightning steps with lowprec's callback, a NaN in NAN_SITE's
    output at step NAN_AT (while it runs below high precision) and the loss x100 at steps
    SPIKE_AT and SPIKE_AT+1, tracked through Lightning's MLFlowLogger into sqlite under `tmp`."""
    from lightning.pytorch.loggers import MLFlowLogger
    from lowprec.integrations.lightning import LowprecCallback
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "lowprec.yaml").write_text(config)
    module = LlamaModule()
    callback = LowprecCallback.from_yaml(tmp / "lowprec.yaml", module.model)
    faults = Faults(module.model, [Injection(FaultKind.NAN, NAN_AT, NAN_AT + 1, NAN_SITE),
                                   Injection(FaultKind.LOSS_SPIKE, SPIKE_AT, SPIKE_AT + 2, factor=100.0)])
    watch = Watch(callback, faults)
    uri = f"sqlite:///{tmp}/mlflow.db"
    logger = MLFlowLogger(experiment_name="lightning-integration", tracking_uri=uri,
                          artifact_location=(tmp / "artifacts").as_uri())
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, logger=logger,
                                log_every_n_steps=5, default_root_dir=str(tmp), callbacks=[callback, watch])
    torch.manual_seed(0)
    trainer.fit(module, loader(8 * (steps + 10)))
    return Run(callback, watch, trainer, module, uri)
