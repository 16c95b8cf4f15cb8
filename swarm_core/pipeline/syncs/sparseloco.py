"""``sync.mode: sparseloco``: SparseLoCo (Sarfi et al., arXiv 2508.15706), DiLoCo's cadence with
each replica's change sent sparse and in a few bits, error feedback in place of outer momentum.

After every ``inner_steps`` steps, replica r with pseudo-gradient D_r (the weights at the last
sync minus its weights now) does::

    e_r <- beta * e_r + D_r               (beta = error_decay)
    S_r = Q(TopK(e_r))                    (the top ``density`` of each tile, ``value_bits`` bits)
    e_r <- e_r - S_r                      (what was not sent waits for the next outer step)
    w <- w_anchor - alpha * mean(S_1 .. S_R)   (alpha = outer_lr, plain SGD: no momentum)

The S_r cross by an all-gather around the group's ring (a sum of sparse tensors is not sparse),
each member's message forwarded R-1 times, and every member decodes the R messages in rank order,
so each computes the same mean to the bit. ``docs/decisions.md`` says where this follows the paper
and its code, and where not.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from swarm_core.config.schemas import SyncConfig, TrainingConfig
from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.optim import ERROR_FIELD
from swarm_core.pipeline.ring import all_gather, confirm, gather_bytes, gather_frames, pieces_of
from swarm_core.pipeline.syncs.diloco import OuterStep, fragment_bounds
from swarm_core.pipeline.syncs.sparse import SparseCode, Tiling, mean_over_senders
from swarm_core.pipeline.transport import PeerLink


class SparseGather:
    """The group's exchange of sparse messages: each member's all-gathered around the ring, the
    contributors' mean at every position held until :meth:`put_back`, which also keeps the
    error feedback this member's message left (nothing changes before it: a broken exchange can
    be done again). Has the parts of :class:`Ring` that :class:`OuterStep` uses."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: SyncConfig,
                 send: PeerLink | None, recv: PeerLink | None, rank: int, replicas: int,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.codes = [SparseCode(Tiling.of(tuple(p.shape), cfg.chunk, cfg.density),
                                 cfg.value_bits) for p in params]
        self.error = [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in params]
        self.device = device
        self.payload = sum(c.size for c in self.codes)
        self.base = 0  # its frames' first number (a fragment's: see OuterStep)
        self._mean: list[torch.Tensor] = []
        self._error: list[torch.Tensor] = []
        self.rewire(send, recv, rank, replicas)

    @property
    def max_payload(self) -> int:
        return max(b - a for a, b in pieces_of(self.payload))

    @property
    def frames(self) -> int:
        return gather_frames(self.payload, self.replicas)

    def expected_bytes(self) -> int:
        return gather_bytes(self.payload, self.replicas)

    def rewire(self, send: PeerLink | None, recv: PeerLink | None, rank: int,
               replicas: int) -> None:
        self.send, self.recv, self.rank, self.replicas = send, recv, rank, replicas

    def sent(self) -> int:
        return self.send.sent if self.send is not None else 0

    def confirm(self, step: int, timeout: float, word: float = 0.0) -> tuple[int, float, float]:
        return confirm(self.send, self.recv, self.replicas, step, timeout, word)

    def close(self) -> None:
        """Nothing of its own to let go (its links are the group's)."""

    @torch.no_grad()
    def reduce_(self, step: int, timeout: float,
                tensors: Sequence[torch.Tensor]) -> tuple[int, float]:
        """Compress this member's change (``tensors``) against its error feedback, all-gather
        the group's messages and hold their mean. Returns the bytes sent and the seconds."""
        t0 = time.perf_counter()
        sent0 = self.sent()
        message, self._error = self._compress(tensors)
        messages = all_gather(self.send, self.recv, self.rank, self.replicas, step, timeout,
                              message, self.base)
        self._mean = [c.tiling.untile(m) for c, m in
                      zip(self.codes, mean_over_senders(self.codes, messages, self.device),
                          strict=True)]
        return self.sent() - sent0, time.perf_counter() - t0

    def _compress(self, tensors: Sequence[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
        """This member's message, and its error feedback once the message is sent."""
        parts, errors = [], []
        beta = self.cfg.error_decay
        for code, e, delta in zip(self.codes, self.error, tensors, strict=True):
            acc = e * beta + delta.detach().float()
            pos, values = code.select(acc)
            raw, decoded = code.encode(pos, values)
            parts.append(raw)
            t = code.tiling
            sent = torch.zeros(t.count, t.size, dtype=torch.float32, device=acc.device)
            errors.append(acc - t.untile(sent.scatter_(1, pos, decoded)))
        return b"".join(parts), errors

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """The held mean into ``tensors``; this member's error feedback becomes what its
        message left."""
        for t, m in zip(tensors, self._mean, strict=True):
            t.copy_(m.view_as(t))
        self.error, self._mean, self._error = self._error, [], []


class SparseLoCo(OuterStep):
    """DiLoCo's outer step over :class:`SparseGather` exchanges (one a fragment): the anchor,
    the overlap, the fragments and the regroup rules are DiLoCo's; the outer SGD has no
    momentum (``outer_step``: lr 1, 0)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], gathers: Sequence[SparseGather],
                 cfg: SyncConfig, steps: int,
                 fragments: Sequence[Sequence[int]] | None = None) -> None:
        super().__init__(params, gathers, cfg, steps, fragments)
        self.gathers = list(gathers)

    def errors(self) -> list[torch.Tensor]:
        """Each parameter's error feedback, in the parameters' order."""
        by_param = {i: e for part, g in zip(self.fragments, self.gathers, strict=True)
                    for i, e in zip(part, g.error, strict=True)}
        return [by_param[i] for i in range(len(self.params))]

    def checkpoint_state(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The outer momentum (none, unless asked for) and the error feedback, as
        ``<parameter>.error_feedback``."""
        out = super().checkpoint_state(names)
        out.update({f"{name}.{ERROR_FIELD}": e.detach().cpu().numpy().copy()
                    for name, e in zip(names, self.errors(), strict=True)})
        return out

    @torch.no_grad()
    def restore_state(self, names: Sequence[str], arrays: dict[str, np.ndarray]) -> None:
        super().restore_state(names, arrays)
        for name, e in zip(names, self.errors(), strict=True):
            if f"{name}.{ERROR_FIELD}" in arrays:
                e.copy_(torch.from_numpy(np.array(arrays[f"{name}.{ERROR_FIELD}"])))

    # (a joiner takes its donor's anchor, not its error feedback: that holds what the donor
    # has yet to send, which the group would then apply twice; the joiner's starts at zero)


def build(training: TrainingConfig, params: Sequence[torch.nn.Parameter], send: PeerLink | None,
          recv: PeerLink | None, rank: int, replicas: int, codec: WireCodec,
          device: torch.device, names: Sequence[str] = ()) -> SparseLoCo:
    params = list(params)
    parts = fragment_bounds([p.numel() for p in params], training.sync.fragments, names,
                            training.sync.fragment_pattern)
    gathers = [SparseGather([params[i] for i in part], training.sync, send, recv, rank,
                            replicas, device) for part in parts]
    return SparseLoCo(params, gathers, training.sync, training.steps, parts)
