"""Optimiser, LR schedule and global gradient clipping, shared by stages and the reference run."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from swarm_core.config.methods import SYNC_METHODS
from swarm_core.config.schemas import TrainingConfig


def make_optimizer(module: nn.Module, cfg: TrainingConfig,
                   grouped: bool = False) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (biases, norms) do not. ``grouped``: the stage is one
    of several replicas, and a sync algorithm that writes its own direction into the
    gradients (``SyncMethod.optimizer`` "sgd": DeMo's sign) has plain SGD take it (no
    momentum: the algorithm's own is the momentum; its weight decay, without momentum, is
    AdamW's decoupled decay: w <- w(1 - lr x wd) - lr x direction)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _name, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if grouped and SYNC_METHODS[cfg.sync.mode].optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.0)
    if cfg.optimizer == "muon":
        from swarm_core.pipeline.muon import make_muon

        return make_muon(module, cfg.weight_decay, cfg.lr, (cfg.betas[0], cfg.betas[1]))
    # foreach left to torch: its multi-tensor kernels on a GPU, the per-parameter loop on the
    # CPU (the single-process reference's, so CPU stages stay bit for bit equal to it).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]),
                             eps=1e-8)


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


# --- optimiser state in checkpoints -------------------------------------------------------------

# AdamW's per-parameter state (and Muon's momentum); a checkpoint member is named
# "<parameter>.<field>".
STATE_FIELDS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


# A sync algorithm's own per-parameter state travels in the same archive as
# "<parameter>.<field>", beside AdamW's (inner) fields: DiLoCo's outer momentum, SparseLoCo's
# error feedback, DeMo's momentum.
OUTER_FIELD = "outer_momentum"
ERROR_FIELD = "error_feedback"
MOMENTUM_FIELD = "decoupled_momentum"
SYNC_FIELDS = (OUTER_FIELD, ERROR_FIELD, MOMENTUM_FIELD)


class OptimizerStateError(ValueError):
    """A checkpoint's optimiser state does not fit this stage's parameters."""


def split_outer(arrays: dict[str, np.ndarray]
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A checkpoint's optimiser arrays as (AdamW's, the sync algorithm's), both keyed
    ``<parameter>.<field>``."""
    inner: dict[str, np.ndarray] = {}
    outer: dict[str, np.ndarray] = {}
    for key, arr in arrays.items():
        (outer if key.rpartition(".")[2] in SYNC_FIELDS else inner)[key] = arr
    return inner, outer


def optimizer_arrays(opt: torch.optim.Optimizer, module: nn.Module) -> dict[str, np.ndarray]:
    """The optimiser's per-parameter state as plain arrays keyed ``<parameter>.<field>``, the
    parameter by its (global) name, so a replacement fellow can take the state over exactly."""
    out: dict[str, np.ndarray] = {}
    for name, p in module.named_parameters():
        for field, value in opt.state.get(p, {}).items():
            if field not in STATE_FIELDS:
                raise OptimizerStateError(f"unexpected optimiser state {field!r} of {name}")
            t = torch.as_tensor(value).detach().cpu()
            if t.dtype == torch.bfloat16:
                t = t.to(torch.float32)  # numpy has no bfloat16
            out[f"{name}.{field}"] = t.numpy().copy()
    return out


def load_optimizer_arrays(opt: torch.optim.Optimizer, module: nn.Module,
                          arrays: dict[str, np.ndarray]) -> None:
    """Install state written by :func:`optimizer_arrays`; checked whole before anything
    changes (an unknown parameter or field, or a shape that does not match, is an error)."""
    params = dict(module.named_parameters())
    groups = {id(q): g for g in opt.param_groups for q in g["params"]}
    state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for key, arr in arrays.items():
        name, _, field = key.rpartition(".")
        p = params.get(name)
        if p is None or field not in STATE_FIELDS:
            raise OptimizerStateError(f"optimiser state {key!r} names no parameter of this "
                                      "stage" if p is None else
                                      f"optimiser state {key!r}: unknown field {field!r}")
        want = () if field == "step" else tuple(p.shape)
        if tuple(arr.shape) != want:
            raise OptimizerStateError(f"optimiser state {key!r} has shape {list(arr.shape)}, "
                                      f"expected {list(want)}")
        t = torch.from_numpy(np.array(arr))
        if field != "step":
            t = t.to(device=p.device, dtype=p.dtype)
        else:
            # step keeps its saved float dtype (torch's default when it was made), on the CPU
            # unless the group is fused or capturable: where AdamW itself would keep it.
            t = t if t.is_floating_point() else t.float()
            group = groups.get(id(p), {})
            if group.get("fused") or group.get("capturable"):
                t = t.to(p.device)
        state.setdefault(p, {})[field] = t
    for p, fields in state.items():
        need = opt.fields(p) if hasattr(opt, "fields") else ("step", "exp_avg", "exp_avg_sq")
        if not set(need) <= set(fields) or not set(fields) <= set(need) | {"max_exp_avg_sq"}:
            name = next(n for n, q in params.items() if q is p)
            raise OptimizerStateError(f"optimiser state of {name} is incomplete: "
                                      f"{sorted(fields)}")
    opt.state.clear()
    for p, fields in state.items():
        opt.state[p] = fields
