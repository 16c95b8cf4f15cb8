"""The whole model in one process: every stage chained, each boundary's codec applied forward
and backward as the wire applies it. The single-process reference trains it, glue rebuilds it
from the stages' shards, and it equals the pipeline by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.boundary import BoundarySimulator, make_boundary
from swarm_core.pipeline.frames import Kind
from swarm_core.pipeline.model import StageModule, dropout_rng


class _WireRoundTrip(torch.autograd.Function):
    """What a boundary does to a tensor in one process: its codec forward (activations) and
    backward (their gradient), by the micro-batch's slot and the step."""

    @staticmethod
    def forward(ctx, x: torch.Tensor,  # type: ignore[override]
                wire: BoundarySimulator, slot: int, step: int) -> torch.Tensor:
        ctx.wire, ctx.slot, ctx.step = wire, slot, step
        return wire.roundtrip(Kind.ACT, x, slot, step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor  # type: ignore[override]
                 ) -> tuple[torch.Tensor, None, None, None]:
        return ctx.wire.roundtrip(Kind.GRAD, grad, ctx.slot, ctx.step), None, None, None


class ExperimentModel(nn.Module):
    """The whole model in one process: the stages chained, each boundary simulated in-process
    (the same codec forward and backward as the wire). Equal to the pipeline by construction."""

    def __init__(self, cfg: ModelConfig, vocab: int, seed: int,
                 ranges: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        ranges = list(ranges or [(0, cfg.n_layers)])
        self.stages = nn.ModuleList(
            StageModule(cfg, vocab, seed, a, b, s, len(ranges)) for s, (a, b) in enumerate(ranges)
        )
        self.boundary = make_boundary(cfg)
        # One per boundary, for the run (each side as the pipeline's stages hold it).
        self.wires = [self.boundary.simulator() for _ in range(len(ranges) - 1)]

    def forward(self, idx: torch.Tensor, step: int | None = None,
                micro_batch: int | None = None) -> torch.Tensor:
        """With ``step`` and ``micro_batch`` (training), dropout draws as each stage of the
        pipeline would (see :func:`dropout_rng`)."""
        x = idx
        for i, stage in enumerate(cast(Sequence[StageModule], self.stages)):
            with dropout_rng(stage, step, micro_batch):
                x = stage(x, idx)  # (the ids: for a stage's frame, see StageModule.frame)
            if i < len(self.stages) - 1 and not self.boundary.exact:
                x = _WireRoundTrip.apply(x, self.wires[i], micro_batch or 0, step or 0)
        return x

    def flat_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter names without the ``stages.N.`` prefix: the glued-model layout."""
        out = {}
        for stage in self.stages:
            out.update(stage.state_dict())
        return out
