"""Forwards of a LowprecTrainer outside its training step: an eval suite's logits and a held batch's loss.

An `eval:` suite scores text through `logits(trainer, tokens)` and the LR probe measures its
held batch through `held_loss(trainer, batches, tokens)`. Every rank calls them alike, in the
same order (the sharded model's forward is collective), and every rank gets the same answer.

Without pipeline parallelism both are the model's forward (`model_parts[0]`) and, for the
loss, torchtitan's loss function. Under pipeline parallelism no rank holds the whole model:
both are an evaluation step of torchtitan's pipeline schedule on every stage
(`pp_schedule.eval`, as torchtitan's `Validator` calls it: the first stage takes the inputs,
the last stage the targets and returns the outputs and the losses), and the last stage's
result reaches every rank of the pp mesh by broadcast
(`lowprec.runtime.engines.pipeline_forward.last_stage_tensor`, shared with `lowprec run`'s Pipeline
engine). The schedule's stages keep the micro-batch shape
of training (torch's pipeline stages size their receive buffers at their first step), so a
suite's batch [B, T] runs as micro-batches of torchtitan's [microbatch size, seq_len]: rows
padded to whole schedule steps, positions padded to seq_len after the text (the model is
causal: a position's logits see none of the padding after it), the padding cut off again.
"""

from __future__ import annotations

import torch

from lowprec.runtime.engines.pipeline_forward import last_stage_tensor

__all__ = ["logits", "held_loss"]


def logits(trainer, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits [B, T, V] on token ids [B, T], on every rank."""
    if trainer.pp_mesh is None:
        model = trainer.model_parts[0]
        return _as_logits(model, model(tokens.to(trainer.device)))
    return _pipeline_logits(trainer, tokens)


def held_loss(trainer, batches: list[tuple[dict, torch.Tensor]], tokens: torch.Tensor) -> torch.Tensor:
    """The loss of held micro-batches ([(input_dict, labels)], one per micro-batch of a pipeline
    step, else one) over `tokens` (the global token count), forward only, as the step's loss is
    reduced (`trainer.global_loss`)."""
    with trainer.not_recorded(), torch.no_grad():
        processed = [trainer.post_dataloading_process(dict(d), y) for d, y in batches]
        with trainer.train_context():
            if trainer.pp_mesh is None:
                (inputs, y, extra), = processed
                pred = trainer.model_parts[0](inputs, **extra)
                kw = {"positions": extra["positions"]} if "positions" in extra else {}
                loss, _ = trainer.loss_fn(pred, y, tokens, **kw)
            else:
                losses = _schedule_eval(trainer, processed, {"global_valid_tokens": tokens})
                loss = torch.sum(torch.stack(losses)) if losses is not None else torch.tensor([-1.0], device=trainer.device)
    return trainer.global_loss(loss.detach())


def _as_logits(model, out: torch.Tensor) -> torch.Tensor:
    if getattr(model, "_skip_lm_head", False):   # torchtitan's chunked loss applies the head itself
        out = model.lm_head(out)
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def _schedule_eval(trainer, processed: list, loss_kwargs: dict | None = None):
    """One evaluation step of torchtitan's pipeline schedule over the processed micro-batches
    ((inputs, labels, extra kwargs) each): the last stage's losses (None on other ranks)."""
    first, last = trainer.pp_has_first_stage, trainer.pp_has_last_stage
    losses = [] if last else None
    trainer.pp_schedule.eval(arg_mbs=[(x,) for x, _, _ in processed] if first else None,
                             kwarg_mbs=[extra for _, _, extra in processed],
                             target_mbs=[y for _, y, _ in processed] if last else None,
                             losses=losses, loss_kwargs=loss_kwargs)
    return losses


def _pipeline_logits(trainer, tokens: torch.Tensor) -> torch.Tensor:
    """`logits` under pipeline parallelism (see the module docstring)."""
    n = trainer.num_pipeline_parallel_microbatches
    rows, seq_len = trainer.config.training.local_batch_size // n, trainer.config.training.seq_len
    b, t = tokens.shape
    if t > seq_len:
        raise ValueError(f"an eval forward of {t} tokens exceeds the pipeline's seq_len {seq_len}; under pipeline "
                         f"parallelism evals run at most training.seq_len tokens (eval max_length)")
    per_step = rows * n
    padded = torch.zeros((-(-b // per_step) * per_step, seq_len), dtype=tokens.dtype, device=trainer.device)
    padded[:b, :t] = tokens.to(trainer.device)
    out = []
    for group in padded.split(per_step):
        processed = [trainer.post_dataloading_process({"input": x}, torch.zeros_like(x)) for x in group.split(rows)]
        with trainer.train_context():   # what torchtitan's Validator runs its steps in
            _schedule_eval(trainer, processed)
        out.append(_last_stage_outputs(trainer))
    return torch.cat(out)[:b, :t]


def _last_stage_outputs(trainer) -> torch.Tensor:
    """The last stage's outputs of the schedule step just run, as float32 logits, on every pp rank
    (`lowprec.runtime.engines.pipeline_forward.last_stage_tensor`)."""
    values = None
    if trainer.pp_has_last_stage:
        stage = next(s for s in _stages(trainer.pp_schedule) if s.is_last)
        values = _as_logits(stage.submod, torch.cat(stage.output_chunks))
    return last_stage_tensor(values, trainer.pp_mesh.get_group(), trainer.pp_mesh.size(), ndim=3,
                             device=trainer.device)


def _stages(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])
