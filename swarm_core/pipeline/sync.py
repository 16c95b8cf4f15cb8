"""A stage group's gradients averaged over its replicas: ring all-reduce on the data plane.

The replicas of one stage hold the same weights; each step each computes the gradients of its
own share of the step's windows, and the group averages them before the optimiser step, so
every replica takes the same step a single process would take over the whole batch (data
parallel). The ring runs over the group's own links, shaped and counted like the pipeline's:
replica r sends to r+1 and receives from r-1. The gradients, flattened into one buffer, are cut
into R chunks; R-1 rounds of reduce-scatter leave each replica the sum of one chunk, R-1 rounds
of all-gather hand every sum round, so each replica sends 2(R-1)/R of the buffer a step, the
least a ring can. Each chunk crosses coded by the group's codec (``training.sync.compression``),
and what arrives is summed in float32 after decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.frames import HEADER_SIZE, Kind
from swarm_core.pipeline.transport import PeerLink


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` contiguous chunks of ``n`` elements, the first ones a
    element longer where ``n`` does not divide."""
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_chunks_sent(rank: int, replicas: int) -> list[int]:
    """The chunks one replica sends in an all-reduce, round by round: reduce-scatter, then
    all-gather."""
    r, n = rank, replicas
    return [(r - i) % n for i in range(n - 1)] + [(r - i + 1) % n for i in range(n - 1)]


def ring_payload_bytes(n: int, replicas: int, codec: WireCodec, rank: int = 0) -> tuple[int, int]:
    """(frames, payload bytes) replica ``rank`` sends in one all-reduce of ``n`` elements."""
    chunks = chunk_bounds(n, replicas)
    sent = ring_chunks_sent(rank, replicas) if replicas > 1 else []
    return len(sent), sum(codec.payload_size((chunks[c][1] - chunks[c][0],)) for c in sent)


class GradientRing:
    """The all-reduce (mean) of one replica's gradients with its group's."""

    def __init__(self, params: Sequence[torch.nn.Parameter], send: PeerLink, recv: PeerLink,
                 rank: int, replicas: int, codec: WireCodec, device: torch.device) -> None:
        self.params = list(params)
        self.send, self.recv = send, recv
        self.rank, self.replicas, self.codec = rank, replicas, codec
        n = sum(p.numel() for p in self.params)
        # One buffer for the run: a fresh one each step costs page faults (see heap.py).
        self.flat = torch.zeros(n, dtype=torch.float32, device=device)
        self.chunks = chunk_bounds(n, replicas)

    @property
    def max_payload(self) -> int:
        """The largest frame payload the ring carries: one chunk, coded."""
        return max(self.codec.payload_size((b - a,)) for a, b in self.chunks)

    def expected_bytes(self) -> int:
        """What one all-reduce sends from this replica, frame headers included."""
        frames, payload = ring_payload_bytes(self.flat.numel(), self.replicas, self.codec,
                                             self.rank)
        return frames * HEADER_SIZE + payload

    def _chunk(self, i: int) -> torch.Tensor:
        a, b = self.chunks[i % self.replicas]
        return self.flat[a:b]

    def all_reduce_mean(self, step: int, timeout: float) -> tuple[int, float]:
        """Replace every parameter's gradient by the group's mean. Returns the bytes it sent
        and the seconds it took (its wait for the group included)."""
        t0 = time.perf_counter()
        sent0 = self.send.sent
        self._gather()
        n = self.replicas
        sends = ring_chunks_sent(self.rank, n)
        for i, out in enumerate(sends):
            # Round i receives the chunk the previous replica sends in it: reduce-scatter
            # sums those into ours, all-gather takes them as they are.
            self._exchange(step, i, out, (out - 1) % n, timeout, add=i < n - 1)
        self.flat.div_(n)
        self._scatter()
        return self.send.sent - sent0, time.perf_counter() - t0

    def _exchange(self, step: int, round_: int, out: int, into: int, timeout: float,
                  add: bool) -> None:
        self.send.send_tensor(Kind.SYNC, step, round_, self._chunk(out), self.codec)
        target = self._chunk(into)
        _, got = self.recv.recv_tensor(Kind.SYNC, step, round_, timeout, target.device,
                                       tuple(target.shape))
        # The chunk sent may still be going out from the buffer itself (an fp32 frame is
        # written from the tensor's memory): let it leave before the buffer changes.
        self.send.flush(timeout)
        if add:
            target.add_(got)
        else:
            target.copy_(got)

    def _gather(self) -> None:
        off = 0
        for p in self.params:
            k = p.numel()
            if p.grad is None:
                self.flat[off:off + k].zero_()
            else:
                self.flat[off:off + k].copy_(p.grad.reshape(-1))
            off += k

    def _scatter(self) -> None:
        off = 0
        for p in self.params:
            k = p.numel()
            mean = self.flat[off:off + k].view_as(p)
            if p.grad is None:
                p.grad = mean.to(p.dtype, copy=True)
            else:
                p.grad.copy_(mean)
            off += k
