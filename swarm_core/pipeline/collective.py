"""``transport: torch``: a stage group's fp32 mean as gloo's ``all_reduce`` on a process
group of its members, in place of the ring of frames.

The group is met over the ring's own torch links (themselves met through the proven data
handshake, see torch_link): its first member hosts a ``TCPStore`` where its ring link was
reached and hands the address round the ring in SYNC frames; every member then builds the
group under a prefix of the ring's tag, which is the membership epoch's (a regroup rings the
members anew, so it meets a fresh group: Prime's ElasticDeviceMesh and torchft make a new
group per membership the same way). Each collective waits at most the frame timeout; a
failure (a member gone, a timeout) is a broken ring, as on the shaped transport.

Lossy codecs (quantized, sparse) keep the ring of frames over the torch links: their
members' sums must decode alike (see Ring._settle), which a gloo sum of raw floats is not.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from swarm_core.pipeline.codecs import FP32_WIRE, WireCodec
from swarm_core.pipeline.frames import FrameError, Kind
from swarm_core.pipeline.ring import Ring, ring_payload_bytes
from swarm_core.pipeline.torch_link import gloo_group, gloo_reason, hosted_store
from swarm_core.pipeline.transport import LinkClosed, PeerLink

MEET_ROUND = (1 << 30) + (1 << 20)  # the meeting's frames' round numbers (after confirm's)


def uses_all_reduce(transport: str, codec: WireCodec) -> bool:
    return transport == "torch" and codec.exact


class Meeting:
    """A stage group's gloo process group, met once per ring (its links, hence its epoch)
    and shared by every all-reduce of the group's sync."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ring: tuple[PeerLink, PeerLink] | None = None
        self._store: Any = None
        self.group: Any = None
        self._busy = 0
        self._released = False

    @contextlib.contextmanager
    def use(self, send: PeerLink, recv: PeerLink, rank: int, replicas: int, step: int,
            timeout: float) -> Iterator[Any]:
        """The group of this ring (met on first use), held for one collective."""
        with self._lock:
            # (the links themselves, not their ids: a regroup's new link may reuse a freed id)
            if self.group is None or self._ring is None \
                    or self._ring[0] is not send or self._ring[1] is not recv:
                self._drop()  # (the last ring's: no collective is pending on it)
                self._released = False
                self.group = self._meet(send, recv, rank, replicas, step, timeout)
                self._ring = (send, recv)
            self._busy += 1
            group = self.group
        try:
            yield group
        finally:
            with self._lock:
                self._busy -= 1
                if self._released and not self._busy:
                    self._drop()

    def release(self) -> None:
        """Let go of the group: its pairs close and the other members' collectives fail at
        once (a member that leaves is seen without waiting out the timeout). Not while a
        collective is pending on it (gloo's destructor would wait for it): then after."""
        with self._lock:
            self._released = True
            if not self._busy:
                self._drop()

    def _drop(self) -> None:
        self.group, self._store, self._ring = None, None, None

    def _meet(self, send: PeerLink, recv: PeerLink, rank: int, replicas: int, step: int,
              timeout: float) -> Any:
        wait = datetime.timedelta(seconds=timeout)
        if rank == 0:
            host = send.sock.getsockname()[0]
            store, port = hosted_store(host, send.sock.family, wait)
            self._store = store
            send.send_raw(Kind.SYNC, step, MEET_ROUND, f"{host}|{port}".encode())
        else:
            _, raw = recv.recv(Kind.SYNC, step, MEET_ROUND, timeout)
            if rank < replicas - 1:
                send.send_raw(Kind.SYNC, step, MEET_ROUND, bytes(raw))
            store = self._store = dist.TCPStore(*_address(bytes(raw)), is_master=False,
                                                timeout=wait)
        send.flush(timeout)
        try:
            return gloo_group(store, f"group/{send.job:x}", send.sock.getsockname()[0], rank,
                              replicas, wait)
        except RuntimeError as exc:
            raise LinkClosed(f"the stage group's gloo rendezvous failed: "
                             f"{gloo_reason(exc)}") from None


def _address(raw: bytes) -> tuple[str, int]:
    """The store's ``host|port`` as the first member said it."""
    try:
        host, _, port = raw.decode("ascii").rpartition("|")
        return host, int(port)
    except ValueError:
        raise FrameError(f"the stage group's store address is not host|port: {raw[:64]!r}") \
            from None


class GroupAllReduce(Ring):
    """:class:`Ring`'s contract (the group's mean of the tensors, in the buffer until
    ``put_back``), by one gloo ``all_reduce`` of the whole buffer. The bytes it reports are
    those a ring all-reduce sends (gloo's own algorithm's, counted, not measured)."""

    def __init__(self, sizes: Sequence[int], send: PeerLink | None, recv: PeerLink | None,
                 rank: int, replicas: int, codec: WireCodec, device: torch.device,
                 meeting: Meeting) -> None:
        super().__init__(sizes, send, recv, rank, replicas, codec, device)
        self.in_place = False  # (gloo sums in the buffer: no frame lands there)
        self.meeting = meeting

    @property
    def frames(self) -> int:
        return 0

    @property
    def max_payload(self) -> int:
        return 128  # (the meeting's address frame)

    def _payload_bytes(self) -> int:
        return ring_payload_bytes(self.flat.numel(), self.replicas, FP32_WIRE, self.rank)[1]

    def expected_bytes(self) -> int:
        return self._payload_bytes()

    def reduce_(self, step: int, timeout: float,
                tensors: Sequence[torch.Tensor]) -> tuple[int, float]:
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            self.flat[off:off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        if self.replicas < 2:
            self.divide_alone()
            return 0, time.perf_counter() - t0
        assert self.send is not None and self.recv is not None
        try:
            with self.meeting.use(self.send, self.recv, self.rank, self.replicas, step,
                                  timeout) as group:
                group.allreduce([self.flat]).wait()
        except RuntimeError as exc:  # (a member gone, or the timeout: the ring is broken)
            raise LinkClosed(f"the stage group's all_reduce failed: {gloo_reason(exc)}") \
                from None
        self.flat.div_(self.mean_of)
        sent = self._payload_bytes()
        self.send.shaper.count_tx(sent)
        self.recv.shaper.count_rx(sent)
        return sent, time.perf_counter() - t0

    def close(self) -> None:
        self.meeting.release()


def ring_maker(transport: str) -> Any:
    """What builds a sync's all-reduces on this transport (one meeting for all of them)."""
    return functools.partial(make_ring, transport, Meeting())


def make_ring(transport: str, meeting: Meeting, sizes: Sequence[int], send: PeerLink | None,
              recv: PeerLink | None, rank: int, replicas: int, codec: WireCodec,
              device: torch.device) -> Ring:
    """The group's all-reduce for this transport and codec (see the module)."""
    if uses_all_reduce(transport, codec):
        return GroupAllReduce(sizes, send, recv, rank, replicas, codec, device, meeting)
    return Ring(sizes, send, recv, rank, replicas, codec, device)
