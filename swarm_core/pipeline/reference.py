"""The single-process run every pipeline is measured against: same seed, init, data order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.data import TokenData
from swarm_core.pipeline.model import StageModule, lm_loss
from swarm_core.pipeline.optim import (
    clip_scale,
    grad_sq_sum,
    lr_at,
    make_optimizer,
    scale_grads,
    set_lr,
)
from swarm_core.pipeline.whole import ExperimentModel


def train_reference(model_cfg: ModelConfig, cfg: TrainingConfig, data: TokenData,
                    ranges: Sequence[tuple[int, int]] | None = None,
                    steps: int | None = None,
                    on_step: Callable[[int, float], None] | None = None,
                    ) -> tuple[list[float], ExperimentModel]:
    """Per-step losses of one process running the micro-batches one after another;
    ``on_step(step, loss)`` after each optimiser step (bench_pipeline times row (a) by it)."""
    torch.set_num_threads(cfg.threads)
    vocab = model_cfg.vocab_size or data.vocab_size
    model = ExperimentModel(model_cfg, vocab, cfg.seed, ranges)
    # Optimiser per stage, in stage order: the same parameter groups as the pipeline's.
    opts = [make_optimizer(stage, cfg) for stage in model.stages]
    params = [p for stage in model.stages for p in stage.parameters() if p.requires_grad]
    stages = cast(Sequence[StageModule], model.stages)
    losses = []
    m = cfg.micro_batches
    for step in range(steps or cfg.steps):
        model.train()
        lr = lr_at(step, cfg)
        for opt in opts:
            set_lr(opt, lr)
        x, y = data.batch(step, cfg.batch_size, model_cfg.seq_len, cfg.seed)
        total = 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            loss = lm_loss(model(xs, step, i), ys) / m
            total += float(loss.detach())
            loss.backward()
        for stage in stages:  # (as the pipeline: see StageModule.constrain_)
            stage.constrain_(grads=True)
        if cfg.grad_clip > 0:
            # Same summation as the pipeline: per stage, then across stages from the last.
            per_stage = [grad_sq_sum(p for p in s.parameters() if p.requires_grad)
                         for s in model.stages]
            acc = 0.0
            for sq in reversed(per_stage):
                acc = sq + acc
            scale_grads(params, clip_scale(acc, cfg.grad_clip))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for stage in stages:
            stage.constrain_()
        losses.append(total)
        if on_step is not None:
            on_step(step, total)
    return losses, model
