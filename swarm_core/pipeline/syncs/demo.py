"""``sync.mode: demo``: DeMo, Decoupled Momentum Optimization (Peng, Quesnelle, Kingma, arXiv
2411.19870; the reference code bloc97/DeMo, and Nous Psyche's DisTrO), every step.

Each replica keeps its own momentum m (never averaged). Every step, with its own clipped
gradient g and the step's learning rate lr::

    m <- momentum_decay * m + lr * g
    C  = the DCT of m in dct_chunk x dct_chunk blocks; q = its topk largest per block
    m <- m - IDCT(q)                        (the fast components leave the momentum once sent)
    g <- sign(IDCT(mean of the group's q))  (at each position, over the members that sent one)

and the stage's plain SGD (no momentum; the matrices' weight decay) steps on g. With
``sign_values`` the q cross as their signs alone (Psyche's 1-bit), one bit each beside their
positions. ``docs/decisions.md`` says where this follows the paper and its code, and where not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from swarm_core.config.schemas import TrainingConfig
from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.optim import MOMENTUM_FIELD, lr_at
from swarm_core.pipeline.ring import (
    LINK_FAULTS,
    RingBroken,
    all_gather,
    confirm,
    confirm_bytes,
    gather_bytes,
    pieces_of,
)
from swarm_core.pipeline.syncs.base import GroupSync, Synced
from swarm_core.pipeline.syncs.sparse import SIGNS, SparseCode, Tiling, mean_over_senders
from swarm_core.pipeline.transport import PeerLink


def dct_matrix(n: int, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II of length n as a matrix D (D @ x transforms x; D.T inverts)."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32).to(device)


class Blocks:
    """One tensor's DCT blocks: to coefficients, (blocks, h x w), and back."""

    def __init__(self, tiling: Tiling, device: torch.device) -> None:
        self.t = tiling
        self.dh, self.dw = dct_matrix(tiling.h, device), dct_matrix(tiling.w, device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        t = self.t
        b = t.tiles(x).view(t.count, t.h, t.w)
        return (self.dh @ b @ self.dw.T).reshape(t.count, t.size)

    def decode(self, c: torch.Tensor) -> torch.Tensor:
        t = self.t
        b = c.reshape(t.count, t.h, t.w)
        return t.untile((self.dh.T @ b @ self.dw).reshape(t.count, t.size))


class DeMo(GroupSync):
    """DeMo's exchange, one member's side, run where the gradients complete (DP's cadence).
    Nothing this member holds changes until :meth:`commit`: a broken exchange can be done
    again over a new ring from the same momentum and gradients."""

    own_state = True  # (each replica's momentum is its own)
    clips_first = True

    def __init__(self, params: Sequence[torch.nn.Parameter], training: TrainingConfig,
                 send: PeerLink | None, recv: PeerLink | None, rank: int, replicas: int,
                 device: torch.device) -> None:
        cfg = training.sync
        self.params, self.training, self.device = list(params), training, device
        self.decay = cfg.momentum_decay
        bits = SIGNS if cfg.sign_values else 32
        self.blocks = [Blocks(Tiling.blocks(tuple(p.shape), cfg.dct_chunk, cfg.topk), device)
                       for p in self.params]
        self.codes = [SparseCode(b.t, bits) for b in self.blocks]
        self.momentum = [torch.zeros(p.shape, dtype=torch.float32, device=device)
                         for p in self.params]
        self.payload = sum(c.size for c in self.codes)
        self._momentum: list[torch.Tensor] = []
        self._direction: list[torch.Tensor] = []
        self.rewire(send, recv, rank, replicas)

    @property
    def max_payload(self) -> int:
        return max(b - a for a, b in pieces_of(self.payload))

    def expected_bytes(self) -> int:
        return gather_bytes(self.payload, self.replicas) + confirm_bytes(self.replicas)

    def rewire(self, send: PeerLink | None, recv: PeerLink | None, rank: int,
               replicas: int) -> None:
        self.send, self.recv, self.rank, self.replicas = send, recv, rank, replicas

    @torch.no_grad()
    def after_backward(self, step: int, timeout: float) -> Synced:
        """This member's components out, the group's in, the sign of their mean held as the
        step's direction; confirmed, it replaces the gradients (:meth:`commit`)."""
        t0 = time.perf_counter()
        sent0 = self.send.sent if self.send is not None else 0
        message = self._compress(lr_at(step, self.training))
        try:
            messages = all_gather(self.send, self.recv, self.rank, self.replicas, step,
                                  timeout, message)
        except LINK_FAULTS as exc:
            raise RingBroken(step, False, exc) from None
        means = mean_over_senders(self.codes, messages, self.device)
        self._direction = [torch.sign(b.decode(m)) for b, m in zip(self.blocks, means,
                                                                    strict=True)]
        try:
            _sent, _wait, self.heard = confirm(self.send, self.recv, self.replicas, step,
                                               timeout, self.word)
        except LINK_FAULTS as exc:
            raise RingBroken(step, True, exc) from None
        self.commit()
        sent = (self.send.sent if self.send is not None else 0) - sent0
        return sent, time.perf_counter() - t0

    def _compress(self, lr: float) -> bytes:
        """This member's message; its momentum once the message is sent, held."""
        parts, self._momentum = [], []
        for p, m, blocks, code in zip(self.params, self.momentum, self.blocks, self.codes,
                                      strict=True):
            grad = p.grad.detach().float() if p.grad is not None else torch.zeros_like(m)
            acc = m * self.decay + grad * lr
            coefficients = blocks.encode(acc)
            pos, values = code.top(coefficients)
            raw, _decoded = code.encode(pos, values)
            parts.append(raw)
            sent = torch.zeros_like(coefficients).scatter_(1, pos, values)
            self._momentum.append(acc - blocks.decode(sent))
        return b"".join(parts)

    @torch.no_grad()
    def commit(self) -> None:
        """The held direction into the gradients, the held momentum kept."""
        for p, d in zip(self.params, self._direction, strict=True):
            p.grad = d.to(p.dtype).view_as(p)
        self.momentum, self._momentum, self._direction = self._momentum, [], []

    def checkpoint_state(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The momentum, as ``<parameter>.decoupled_momentum``."""
        return {f"{name}.{MOMENTUM_FIELD}": m.detach().cpu().numpy().copy()
                for name, m in zip(names, self.momentum, strict=True)}

    @torch.no_grad()
    def restore_state(self, names: Sequence[str], arrays: dict[str, np.ndarray]) -> None:
        for name, m in zip(names, self.momentum, strict=True):
            if f"{name}.{MOMENTUM_FIELD}" in arrays:
                m.copy_(torch.from_numpy(np.array(arrays[f"{name}.{MOMENTUM_FIELD}"])))

    # (a joiner's momentum starts at zero: its donor's holds what the donor has yet to send,
    # which the group would then apply twice)


def build(training: TrainingConfig, params: Sequence[torch.nn.Parameter], send: PeerLink | None,
          recv: PeerLink | None, rank: int, replicas: int, codec: WireCodec,
          device: torch.device, names: Sequence[str] = ()) -> DeMo:
    return DeMo(params, training, send, recv, rank, replicas, device)
