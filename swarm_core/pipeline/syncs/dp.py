"""``sync.mode: dp``: data parallel. Every step each gradient becomes the group's mean over
its replicas before clipping and the optimiser step, so every replica takes the step one process
would take over the whole batch.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from swarm_core.config.schemas import TrainingConfig
from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.collective import ring_maker
from swarm_core.pipeline.ring import LINK_FAULTS, Ring, RingBroken, confirm_bytes
from swarm_core.pipeline.syncs.base import GroupSync, Synced
from swarm_core.pipeline.transport import PeerLink, farewell

FIRST_BUCKET_BYTES = 1 << 20  # as DDP: the last layers' gradients go out early


def buckets_of(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices in buckets of about ``bucket_bytes`` (fp32), from the last parameter
    back (the order the backward finishes them in); the first bucket at most 1 MiB."""
    out: list[list[int]] = [[]]
    cap, filled = min(FIRST_BUCKET_BYTES, bucket_bytes), 0
    for i in reversed(range(len(sizes))):
        if out[-1] and filled + 4 * sizes[i] > cap:
            out.append([])
            cap, filled = bucket_bytes, 0
        out[-1].append(i)
        filled += 4 * sizes[i]
    return out


class GradientAverage(GroupSync):
    """Data parallel (``sync.mode: dp``): every step each gradient becomes the group's mean,
    before clipping and the optimiser step. The gradients go in buckets (``sync.bucket_mb``),
    each its own all-reduce on a thread of its own: armed for a step's last backward, a bucket
    goes out as soon as the backward has finished all its gradients, while the earlier layers'
    are still being computed (DDP's overlap); the rest go after the backward, in the same
    order on every replica (their frames are numbered by bucket and round)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], send: PeerLink | None,
                 recv: PeerLink | None, rank: int, replicas: int, codec: WireCodec,
                 device: torch.device, bucket_bytes: int,
                 make_ring: Callable[..., Ring] = Ring) -> None:
        self.params = list(params)
        self.buckets = buckets_of([p.numel() for p in self.params], bucket_bytes)
        self.rings = [make_ring([self.params[i].numel() for i in b], send, recv, rank,
                                replicas, codec, device) for b in self.buckets]
        self._number()
        self._bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self._armed = False  # for this step's last backward
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to go out
        self._step, self._timeout = 0, 0.0
        self._jobs: queue.SimpleQueue[tuple[int, int, float] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[int, float] | BaseException] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name="ring-all-reduce",
                                        daemon=True)
        self._worker.start()
        self._hooks = [p.register_post_accumulate_grad_hook(
            functools.partial(self._on_grad, i)) for i, p in enumerate(self.params)]
        self.word = self.heard = 0.0  # the membership proposed, and agreed, at confirmation

    @property
    def max_payload(self) -> int:
        return max(r.max_payload for r in self.rings)

    def expected_bytes(self) -> int:
        return sum(r.expected_bytes() for r in self.rings) + \
            confirm_bytes(self.rings[0].replicas, 1 if self.own is None else 2)

    def rewire(self, send: PeerLink | None, recv: PeerLink | None, rank: int,
               replicas: int) -> None:
        for ring in self.rings:
            ring.rewire(send, recv, rank, replicas)
        self._number()

    def divide_by(self, shares: int | None) -> None:
        """Each gradient's sum over the group divided by ``shares`` rather than by its
        members: a layout's stage (pipeline/layout), whose cells together ran the job's
        ``shares`` data shares whatever their number. None: by its members."""
        for ring in self.rings:
            ring.divisor = shares

    def _number(self) -> None:
        """Each bucket's frames numbered after those of the buckets before it."""
        base = 0
        for ring in self.rings:
            ring.base = base
            base += ring.frames

    def arm(self, step: int, timeout: float) -> None:
        """The next backward is the step's last: send each bucket as it completes."""
        self._armed, self._ready = True, [0] * len(self.buckets)
        self._next, self._step, self._timeout = 0, step, timeout
        for ring in self.rings:  # (the frames land in place from the first one)
            ring.expect(step)

    def _on_grad(self, index: int, _param: torch.Tensor) -> None:
        if not self._armed:
            return  # (an earlier micro-batch's backward)
        k = self._bucket_of[index]
        self._ready[k] += 1
        while self._next < len(self.buckets) and \
                self._ready[self._next] == len(self.buckets[self._next]):
            self._launch()

    def _launch(self) -> None:
        k = self._next
        self._next += 1
        self._jobs.put((k, self._step, self._timeout))

    def _grads(self, k: int) -> list[torch.Tensor]:
        return [self.params[i].grad for i in self.buckets[k]]  # type: ignore[misc]

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            k, step, timeout = job
            try:
                self._done.put(self.rings[k].reduce_(step, timeout, self._grads(k)))
            except BaseException as exc:  # (handed to the stage's thread, raised there)
                self._done.put(exc)

    def after_backward(self, step: int, timeout: float) -> Synced:
        """Every bucket's mean over the group, confirmed, into the gradients. On a broken ring
        (RingBroken) the gradients still hold this member's own: the step can be done again
        over a new ring, or :meth:`commit` what this member already holds."""
        if not self._armed:  # (every bucket goes now)
            self._next, self._step, self._timeout = 0, step, timeout
        self._armed = False
        for p in self.params:
            if p.grad is None:  # (a part that got no gradient this step counts as zero)
                p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        while self._next < len(self.buckets):
            self._launch()
        sent, error = 0, None
        for _ in self.buckets:
            got = self._done.get()
            if isinstance(got, BaseException):
                if error is None and isinstance(got, LINK_FAULTS):
                    self._close_ring()  # (the buckets still queued fail at once)
                error = error or got
            else:
                sent += got[0]
        if error is not None:
            if isinstance(error, LINK_FAULTS):
                raise RingBroken(step, False, error)
            raise error
        try:
            if self.own is None:
                more, _wait, self.heard = self.rings[0].confirm(step, timeout, self.word)
            else:
                more, _wait, self.heard, self.told = self.rings[0].confirm_telling(
                    step, timeout, self.word, self.own)
            sent += more
        except LINK_FAULTS as exc:
            raise RingBroken(step, True, exc) from None
        self.commit()
        # What the step waited for the group: the time the buckets took after the backward.
        return sent, time.perf_counter() - t0

    def commit(self) -> None:
        """Apply the group's mean, which every bucket holds (this member finished). Each
        float32 gradient becomes a view of its bucket's buffer rather than a copy of it: no
        pass over the gradients after the backward (the optimiser step reads the views, and
        zero_grad lets them go before the next step refills the buffer)."""
        for k, ring in enumerate(self.rings):
            off = 0
            for i in self.buckets[k]:
                p = self.params[i]
                view = ring.flat[off:off + p.numel()].view_as(p)
                off += p.numel()
                if p.dtype == view.dtype:
                    p.grad = view
                else:  # (a lower-precision model: its gradients keep their own dtype)
                    p.grad.copy_(view)  # type: ignore[union-attr]

    def _close_ring(self) -> None:
        ring = self.rings[0]
        links = [x for x in (ring.send, ring.recv) if x is not None]
        farewell(links)  # (this member lets go to regroup: its neighbours must not blame it)
        for link in links:
            link.close()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._jobs.put(None)
        for ring in self.rings:
            ring.close()


def build(training: TrainingConfig, params: Sequence[torch.nn.Parameter], send: PeerLink | None,
          recv: PeerLink | None, rank: int, replicas: int, codec: WireCodec,
          device: torch.device, names: Sequence[str] = ()) -> GradientAverage:
    return GradientAverage(params, send, recv, rank, replicas, codec, device,
                           int(training.sync.bucket_mb * 2**20),
                           ring_maker(training.transport))
