"""Optimiser, LR schedule and global gradient clipping, shared by stages and the reference run."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from swarm_core.config.schemas import TrainingConfig


def make_optimizer(module: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (biases, norms) do not."""
    decay, no_decay = [], []
    for _name, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8,
                             foreach=False)


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from ``lr`` to ``min_lr``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def grad_sq_sum(params: Iterable[nn.Parameter]) -> float:
    """Sum of squared gradients in float64, in parameter order (same order everywhere)."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return total


def clip_scale(total_sq: float, max_norm: float) -> float:
    if max_norm <= 0:
        return 1.0
    norm = math.sqrt(total_sq)
    return min(1.0, max_norm / (norm + 1e-6))


def scale_grads(params: Iterable[nn.Parameter], scale: float) -> None:
    if scale >= 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
