"""The whole model in one process: every stage chained, each boundary's codec applied forward
and backward as the wire applies it. The single-process reference trains it, glue rebuilds it
from the stages' shards, and it equals the pipeline by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline import codecs
from swarm_core.pipeline.model import StageModule, dropout_rng


class _WireRoundTrip(torch.autograd.Function):
    """What a boundary does to a tensor in one process: the codec forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor,  # type: ignore[override]
                codec: codecs.WireCodec) -> torch.Tensor:
        ctx.codec = codec
        return codec.roundtrip(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor  # type: ignore[override]
                 ) -> tuple[torch.Tensor, None]:
        return ctx.codec.roundtrip(grad), None


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
        self.codec = codecs.WireCodec.of(cfg)

    def forward(self, idx: torch.Tensor, step: int | None = None,
                micro_batch: int | None = None) -> torch.Tensor:
        """With ``step`` and ``micro_batch`` (training), dropout draws as each stage of the
        pipeline would (see :func:`dropout_rng`)."""
        x = idx
        for i, stage in enumerate(self.stages):
            with dropout_rng(stage, step, micro_batch):
                x = stage(x)
            if i < len(self.stages) - 1 and not self.codec.exact:
                x = _WireRoundTrip.apply(x, self.codec)
        return x

    def flat_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter names without the ``stages.N.`` prefix: the glued-model layout."""
        out = {}
        for stage in self.stages:
            out.update(stage.state_dict())
        return out
