"""What the tests of the sparse sync modes (SparseLoCo, DeMo) share: the pipeline's schedule and
tile rule written plainly, a run checkpointed and resumed with or without a sync's own state."""

from __future__ import annotations

import math

import numpy as np
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.stage import StageResult
from tests.unit.test_replicas import _Checkpoints, _step_losses


def divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` up to ``at_most``."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def lr_at(tc: TrainingConfig, step: int) -> float:
    """Linear warm-up, then cosine to min_lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def fragment_of(stages: list[torch.nn.Module], fragments: int,
                pattern: str = "strided") -> list[int]:
    """Streaming DiLoCo's fragments, as the docs say them, over every stage in turn: each
    parameter's fragment. Strided (the paper's): the stage's k-th transformer block in
    fragment k mod P, what comes before its first block with the first and after its last
    with the last. Sequential, or where a stage holds fewer blocks than fragments: the
    stage's parameters in ``fragments`` contiguous runs of about equal elements, a
    parameter in the one its middle element falls in."""
    out = []
    for stage in stages:
        named = list(stage.named_parameters())
        block = [int(n.split(".")[1]) if n.startswith("blocks.") else None for n, _ in named]
        found = sorted({b for b in block if b is not None})
        if pattern == "strided" and len(found) >= fragments:
            k = 0
            for b in block:
                k = found.index(b) if b is not None else k
                out.append(k % fragments)
            continue
        sizes = [p.numel() for _, p in named]
        before = 0
        for n in sizes:
            out.append(min(fragments - 1, fragments * (2 * before + n) // (2 * sum(sizes))))
            before += n
    return out


def fragments_after(tc: TrainingConfig, step: int, every: bool) -> set[int]:
    """The fragments whose outer step runs after 0-based step ``step``: fragment f after the
    1-based steps n with n mod H = floor((f+1) H / P) mod H (each every H steps, H/P apart
    where P divides H); all of them at the last step and where ``every`` (a checkpoint)."""
    p, h, n = tc.sync.fragments, tc.sync.inner_steps, step + 1
    turn = {f for f in range(p) if n % h == (f + 1) * h // p % h}
    if n == tc.steps or (every and turn):
        return set(range(p))
    return turn


def present(replicas: int, step: int, steps: int, leaves: dict[int, int],
            joins: dict[int, tuple[int, int]]) -> list[int]:
    """The replicas that train step ``step``: those not gone (``leaves[r]``: gone from that
    step), and those back (``joins[r] = (step, donor)``: back from that step)."""
    return [r for r in range(replicas) if leaves.get(r, steps + 1) > step
            or (r in joins and joins[r][0] <= step)]


def backward_shares(models: list[torch.nn.Module], here: list[int], x: torch.Tensor,
                    y: torch.Tensor, tc: TrainingConfig, replicas: int) -> float:
    """Each replica in ``here`` takes its share of the step's windows in micro-batches, its
    gradients clipped by its own global norm; returns the step's loss (the mean over them)."""
    from swarm_core.pipeline.model import lm_loss

    share, m, total = tc.batch_size // replicas, tc.micro_batches, 0.0
    for r in here:
        xs, ys = x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]
        for xm, ym in zip(xs.chunk(m), ys.chunk(m), strict=True):
            loss = lm_loss(models[r](xm), ym) / m
            total += float(loss.detach()) / len(here)
            loss.backward()
        params = list(models[r].parameters())
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
        if norm + 1e-6 > tc.grad_clip:
            for p in params:
                p.grad.mul_(tc.grad_clip / (norm + 1e-6))
    return total


def close(ref: list[float], got: list[float]) -> float:
    """The largest difference of two runs' step losses (of the same length)."""
    assert len(ref) == len(got)
    return max(abs(a - b) for a, b in zip(ref, got, strict=True))


def resumed_runs(mc: ModelConfig, tc: TrainingConfig, data, at: int, field: str
                 ) -> tuple[list[float], list[float]]:
    """Two replicas checkpointed after step ``at``, whose checkpoints hold each replica's own
    ``<parameter>.<field>`` (different per replica); then two runs resumed from them: with
    that state, and without it. Returns their step losses."""
    ckpt = _Checkpoints(2)
    res = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120,
                             stage_kwargs=ckpt.kwargs(2))
    assert all(isinstance(r, StageResult) for r in res.values()), res
    own = [{k: v for k, v in ckpt.saved[c][at][1].items() if k.endswith(field)} for c in (0, 1)]
    assert own[0] and set(own[0]) == set(own[1])
    assert any(not np.array_equal(own[0][k], own[1][k]) for k in own[0])

    def resumed(keep: bool) -> list[float]:
        kwargs = {}
        for c in (0, 1):
            opt = {k: v for k, v in ckpt.saved[c][at][1].items()
                   if keep or not k.endswith(field)}
            kwargs[c] = {"start_step": at, "initial_state": ckpt.saved[0][at][0],
                         "initial_optimizer": opt}
        again = run_local_pipeline(mc, tc, data, 1, replicas=2, timeout=120,
                                   stage_kwargs=kwargs)
        assert all(isinstance(r, StageResult) for r in again.values()), again
        return _step_losses(again, 1, 2)

    return resumed(keep=True), resumed(keep=False)
