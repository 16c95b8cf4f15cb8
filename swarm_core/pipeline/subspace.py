"""Subspace Networks' boundary (``subspace_kK``; Ramasinghe et al., arXiv 2506.01260).

The model keeps its residual stream in ``E(tokens) + U·c``: U is a fixed dxK orthonormal
basis and E a fixed token + position embedding, both drawn from the run seed and so the same
on every stage (every stage also reads the step's token ids, see
``Compression.every_stage_reads_tokens``). Every parameter that writes into the stream (the
attention and MLP output projections and their biases, the trainable token and position
tables) is kept in span(U): projected at initialisation, its gradient projected before the
optimiser step and its value after it (``StageModule.constrain_``). Then the boundary is
exact: the sender sends ``c = Uᵀ(x - E(tokens))``, K values per token, and the receiver
rebuilds ``x = E(tokens) + U·c``; autograd through these two linear maps sends ``Uᵀ·∂L/∂x``
back and turns it into ``U·g`` on the sender. What crosses is coded by the spec's element
(``_int8``, ``_fp8``, ``_bB``) like any other boundary tensor, K wide.

Why the gradients are projected too: the stage before a boundary only ever learns Uᵀ·∂L/∂x,
so the writers it holds get the projected gradient P·G (P = UUᵀ). Projecting every writer's
gradient the same way (a linear map: it commutes with micro-batch accumulation and a replica
group's mean) makes a one-process run of the same constrained model take the very same steps,
for any optimiser; AdamW's per-element update of P·G is not in span(U) itself, hence the
projection after the step as well. Every other parameter's gradient depends on ∂L/∂x only
through a writer's transpose, which already sees only Uᵀ·∂L/∂x.

How U and E are drawn (a public recipe: the test's independent reference draws them so):
torch's CPU generator seeded with ``model.part_seed(seed, "subspace")``; then a dxK standard
normal matrix, whose QR factor Q (``torch.linalg.qr``, reduced) is U; then the vocabxd token
table and the seq_lenxd position table of E, each N(0, 0.02²) (GPT-2's embedding scale).
"""

from __future__ import annotations

import torch
from torch import nn

from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.boundary import Boundary

EMBED_STD = 0.02  # E's tables, as GPT-2 draws an embedding


class Subspace(nn.Module):
    """U and E of a run (non-persistent buffers: rebuilt from the seed, never in a shard),
    and the maps either side of a boundary. Build it under ``seeded(seed, "subspace", …)``."""

    basis: torch.Tensor  # U, d x K
    tok: torch.Tensor  # E's tables: vocab x d, seq_len x d
    pos: torch.Tensor

    def __init__(self, cfg: ModelConfig, vocab: int) -> None:
        super().__init__()
        k = cfg.compression_spec.subspace
        assert k is not None, "a subspace spec"
        basis, _ = torch.linalg.qr(torch.randn(cfg.d_model, k))
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("tok", torch.randn(vocab, cfg.d_model) * EMBED_STD,
                             persistent=False)
        self.register_buffer("pos", torch.randn(cfg.seq_len, cfg.d_model) * EMBED_STD,
                             persistent=False)

    def fixed(self, tokens: torch.Tensor) -> torch.Tensor:
        """E(tokens): (batch, time) ids to (batch, time, d)."""
        return self.tok[tokens] + self.pos[: tokens.shape[1]]

    def enter(self, x: torch.Tensor, tokens: torch.Tensor, first: bool) -> torch.Tensor:
        """The stream at a stage's start: the trainable embedding plus E (the first stage),
        or E plus U·c from the coordinates ``x`` that crossed."""
        with torch.autocast(x.device.type, enabled=False):  # (float32: the map is exact)
            if first:
                return x.float() + self.fixed(tokens)
            return self.fixed(tokens) + x.float() @ self.basis.T

    def leave(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What crosses: the stream's coordinates c = Uᵀ(x - E(tokens))."""
        with torch.autocast(x.device.type, enabled=False):
            return (x.float() - self.fixed(tokens)) @ self.basis

    @torch.no_grad()
    def project_(self, t: torch.Tensor, axis: int) -> None:
        """``t`` onto span(U) along its d-wide ``axis`` (0: a Linear's output rows or a bias;
        -1: an embedding table's rows), in place."""
        u = self.basis
        t.copy_(u @ (u.T @ t) if axis == 0 else (t @ u) @ u.T)


class SubspaceBoundary(Boundary):
    """``subspace_kK[_E[_bB]]``: no modules either side (the maps are the stages' frame, see
    :meth:`frame_module`), the spec's stateless codec on the K-wide coordinates."""

    def frame_module(self, vocab: int) -> Subspace:
        return Subspace(self.cfg, vocab)
