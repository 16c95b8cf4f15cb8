"""A stage group's ring all-reduce on the data plane: the mean of tensors over its replicas.

The replicas of one stage hold the same weights; each step each computes the gradients of its
own share of the step's windows, and the group averages them before the optimiser step, so
every replica takes the same step a single process would take over the whole batch (data
parallel). The ring runs over the group's own links, shaped and counted like the pipeline's:
replica r sends to r+1 and receives from r-1. The gradients, flattened into one buffer, are cut
into R chunks; R-1 rounds of reduce-scatter leave each replica the sum of one chunk, R-1 rounds
of all-gather hand every sum round, so each replica sends 2(R-1)/R of the buffer a step, the
least a ring can. Each chunk crosses coded by the group's codec (``training.sync.compression``),
in lanes of a few MiB that each go on as soon as they are summed, and what arrives is summed
in float32 after decoding.

A result is applied only once every member has it: after the last round, R-1 rounds of a
four-byte frame carry each member's "finished" around the ring (the confirmation). A member
that dies mid-operation thus leaves the survivors either all unconfirmed, each still holding
its own part, or some confirmed and every other finished (see ``contract/membership.py``);
either way the group agrees on what the operation did once it regroups (:class:`RingBroken`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from swarm_core.pipeline import codecs
from swarm_core.pipeline.codecs import FP32_WIRE as FP32
from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.frames import HEADER_SIZE, FrameError, Kind
from swarm_core.pipeline.transport import LinkClosed, PeerLink, PeerTimeout

CONFIRM_ROUND = 1 << 30  # the confirmation's frames' first round number (after every bucket's)
STATE_ROUND = (1 << 31) - 1  # the frame that hands a joining replica its state
LINK_FAULTS = (LinkClosed, PeerTimeout, OSError)  # what breaks a ring (see RingBroken)


class RingBroken(Exception):
    """A synchronisation of the stage group broke on a member's link (it closed, broke or went
    quiet). ``finished``: this member had the operation's whole result, unconfirmed."""

    def __init__(self, step: int, finished: bool, cause: BaseException) -> None:
        super().__init__(f"the group's ring broke at step {step}: {cause}")
        self.step, self.finished, self.cause = step, finished, cause


def confirm_bytes(replicas: int, words: int = 1) -> int:
    """What one member sends to confirm an operation: R-1 frames of ``words`` float32s (two
    where each member also tells its measured compute: ``routing: measured``)."""
    return (replicas - 1) * (HEADER_SIZE + 4 * words)


def chunk_bounds(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` contiguous chunks of ``n`` elements (a multiple of
    ``align``), each a whole number of ``align``-element blocks (an int8 codec's scale
    blocks), the first ones a block longer where they do not divide."""
    if n % align:
        raise ValueError(f"{n} elements are not whole blocks of {align}")
    size, extra = divmod(n // align, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + (size + (i < extra)) * align
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_chunks_sent(rank: int, replicas: int) -> list[int]:
    """The chunks one replica sends in an all-reduce, round by round: reduce-scatter, then
    all-gather."""
    r, n = rank, replicas
    return [(r - i) % n for i in range(n - 1)] + [(r - i + 1) % n for i in range(n - 1)]


def ring_payload_bytes(n: int, replicas: int, codec: WireCodec, rank: int = 0) -> tuple[int, int]:
    """(frames, payload bytes) replica ``rank`` sends in one all-reduce of ``n`` elements
    (a multiple of the codec's block: see :class:`Ring`)."""
    lanes = lane_bounds(n, replicas, codec.block or 1)
    sent = ring_chunks_sent(rank, replicas) if replicas > 1 else []
    return len(sent) * len(lanes[0]), sum(_payload(codec, b - a) for c in sent
                                          for a, b in lanes[c])


LANE_BYTES = 4 << 20


def lane_count(chunks: Sequence[tuple[int, int]], align: int) -> int:
    """The frames each chunk crosses in (its lanes, of about LANE_BYTES of float32 each,
    whole blocks): the ring passes a lane on as soon as it has summed it, while the next
    arrive, rather than a whole chunk after the whole chunk (see :meth:`Ring.reduce_`)."""
    size = max(b - a for a, b in chunks)
    return max(1, min(size // align, -(-size * 4 // LANE_BYTES)))


def lane_bounds(n: int, replicas: int, align: int) -> list[list[tuple[int, int]]]:
    """``[start, stop)`` in the buffer of each chunk's lanes (the same count for every
    chunk, whole blocks of ``align``)."""
    chunks = chunk_bounds(n, replicas, align)
    lanes = lane_count(chunks, align)
    return [[(a + x, a + y) for x, y in chunk_bounds(b - a, lanes, align)] for a, b in chunks]


def _payload(codec: WireCodec, n: int) -> int:
    """A chunk's payload: an empty one (fewer blocks than members) crosses as fp32, 0 bytes."""
    return codec.payload_size((n,)) if n else 0


class Ring:
    """The all-reduce (mean) of tensors over a stage group, around its ring."""

    def __init__(self, sizes: Sequence[int], send: PeerLink | None, recv: PeerLink | None,
                 rank: int, replicas: int, codec: WireCodec, device: torch.device,
                 base: int = 0) -> None:
        self.codec = codec
        self.base = base  # its frames' first number (a bucket's, after those before it)
        # Chunks are whole int8 scale blocks, so the buffer is padded with zeros to a whole
        # number of them (less than a block: every member pads alike, and zeros sum to zero).
        self.align = codec.block or 1
        n = -(-sum(sizes) // self.align) * self.align
        # One buffer for the run: a fresh one each step costs page faults (see heap.py).
        self.flat = torch.zeros(n, dtype=torch.float32, device=device)
        self._pad = torch.zeros(n - sum(sizes), dtype=torch.float32, device=device)
        # Exact (fp32) on the CPU, every frame lands in its place in the buffer (see
        # expect), and the tensors are read as given, never copied in (see reduce_).
        self.in_place = codec.exact and self.flat.device.type == "cpu"
        # What the group's sum is divided by: its member count (None), or under a layout
        # whose stages have unequal cells the job's data shares (see pipeline/layout).
        self.divisor: int | None = None
        self.rewire(send, recv, rank, replicas)

    @property
    def frames(self) -> int:
        """The frames one all-reduce numbers (each round's lanes)."""
        return 2 * (self.replicas - 1) * self.lanes

    @property
    def max_payload(self) -> int:
        """The largest frame payload the ring carries: one lane, coded."""
        return max(_payload(self.codec, b - a) for lanes in self._lanes for a, b in lanes)

    def expected_bytes(self) -> int:
        """What one all-reduce sends from this replica, frame headers included."""
        frames, payload = ring_payload_bytes(self.flat.numel(), self.replicas, self.codec,
                                             self.rank)
        return frames * HEADER_SIZE + payload

    def rewire(self, send: PeerLink | None, recv: PeerLink | None, rank: int,
               replicas: int) -> None:
        """The group's ring, at the start and after a regroup (one member: no links,
        nothing crosses)."""
        self.send, self.recv, self.rank, self.replicas = send, recv, rank, replicas
        self._lanes = lane_bounds(self.flat.numel(), replicas, self.align)
        self.lanes = len(self._lanes[0])
        self._landed = -1  # the step whose frames have their landings set

    def sent(self) -> int:
        return self.send.sent if self.send is not None else 0

    def _frame(self, i: int, j: int) -> int:
        return self.base + i * self.lanes + j

    def _lane(self, c: int, j: int) -> torch.Tensor:
        a, b = self._lanes[c % self.replicas][j]
        return self.flat[a:b]

    def expect(self, step: int) -> None:
        """An exact ring on the CPU: have step ``step``'s frames read straight into their
        lanes of the buffer (see :meth:`PeerLink.land`), set before they can come (a data
        parallel step's when its last backward is armed, once the step before has let go of
        the buffer). A lane's memory is free when its frame comes: a reduce-scatter lane is
        this member's to sum into only once it has come (this member's part is read from the
        tensors, never from the buffer); an all-gather lane comes only once every member's
        part of it is summed, this member's included (sent from that part of the buffer, or
        from the tensors, before any later round's frame can be under way to it)."""
        n = self.replicas
        if n < 2 or self.recv is None or not self.in_place or self._landed == step:
            return
        self._landed = step
        into = {}
        for i, out in enumerate(ring_chunks_sent(self.rank, n)):
            for j in range(self.lanes):
                lane = self._lane(out - 1, j)
                if lane.numel():
                    into[self._frame(i, j)] = codecs.as_bytes(lane)
        self.recv.land(Kind.SYNC, step, into)

    def reduce_(self, step: int, timeout: float,
                tensors: Sequence[torch.Tensor]) -> tuple[int, float]:
        """The group's mean of each of ``tensors`` (in this order on every replica), held in
        this ring's buffer until :meth:`put_back`: the tensors keep this member's own part.
        Returns the bytes this replica sent and the seconds it took (its wait for the group
        included).

        Each chunk crosses in lanes, and each lane goes on as soon as it has come and been
        summed (or taken), so the rounds overlap: a member sums lane j while lane j+1
        arrives and lane j-1 leaves, instead of waiting for a whole chunk each round."""
        t0 = time.perf_counter()
        sent0 = self.sent()
        n = self.replicas
        # Exact, the tensors need no copy in: the first round sends this member's part from
        # them and each lane it receives is summed with its part into the buffer. The
        # tensors are never written, so they keep this member's part (for a redo).
        direct = self.in_place and n > 1
        own = [t.reshape(-1) for t in tensors]
        if direct:
            own = [t if t.dtype == torch.float32 else t.float() for t in own]
            lo = self.flat.data_ptr()
            hi = lo + 4 * self.flat.numel()
            if any(lo <= t.data_ptr() < hi for t in own):  # (frames land in the buffer)
                raise RuntimeError("the ring's tensors are views of its own buffer")
        own.append(self._pad)
        if not direct:
            off = 0
            for t in own:
                self.flat[off:off + t.numel()].copy_(t)
                off += t.numel()
            own = []
        if n < 2:
            self.divide_alone()
            return 0, time.perf_counter() - t0
        assert self.send is not None and self.recv is not None
        self.expect(step)
        sent = ring_chunks_sent(self.rank, n)
        for j in range(self.lanes):
            self._send(step, 0, sent[0], j, own)
        for i, out in enumerate(sent):
            into = (out - 1) % n  # (round i receives the chunk the previous replica sends)
            for j in range(self.lanes):
                lane = self._lane(into, j)
                _, got = self.recv.recv_tensor(Kind.SYNC, step, self._frame(i, j), timeout,
                                               lane.device, tuple(lane.shape))
                coded = None
                landed = got.numel() and got.data_ptr() == lane.data_ptr()
                if i < n - 1:  # reduce-scatter: sum it into ours
                    if own:
                        for at, piece in self._own(own, into, j):
                            part = lane[at:at + piece.numel()]
                            if landed:  # (got + own: the same sum, to the bit)
                                part.add_(piece)
                            else:
                                torch.add(piece, got[at:at + piece.numel()], out=part)
                    else:
                        lane.add_(got)
                    if i == n - 2:  # (ours to hand round: first its mean, as sent)
                        coded = self._settle(lane)
                elif not landed:
                    lane.copy_(got)  # all-gather: take it
                if i + 1 < len(sent):  # (what came in round i goes out in round i+1)
                    self._send(step, i + 1, into, j, None, coded)
        # Nothing may still be leaving from the buffer or the tensors once this returns.
        self.send.flush(timeout)
        return self.sent() - sent0, time.perf_counter() - t0

    def _send(self, step: int, i: int, c: int, j: int, own: list[torch.Tensor] | None,
              coded: list[memoryview] | None = None) -> None:
        """Lane ``j`` of chunk ``c`` as round ``i``'s frame: ``coded`` as given, the first
        round's from the tensors (``own``), else from the buffer."""
        assert self.send is not None
        lane, frame = self._lane(c, j), self._frame(i, j)
        if coded is not None:
            self.send.send_coded(Kind.SYNC, step, frame, tuple(lane.shape), self.codec, coded,
                                 coded)
        elif own:
            pieces = [p for _, p in self._own(own, c, j)]
            self.send.send_coded(Kind.SYNC, step, frame, tuple(lane.shape), FP32,
                                 [codecs.as_bytes(p) for p in pieces], pieces)
        else:  # (an empty lane, fewer blocks than lanes, crosses as fp32: no rows to scale)
            self.send.send_tensor(Kind.SYNC, step, frame, lane,
                                  self.codec if lane.numel() else FP32)

    def _own(self, own: list[torch.Tensor], c: int, j: int) -> list[tuple[int, torch.Tensor]]:
        """The pieces of the tensors that lane ``j`` of chunk ``c`` covers, with their
        offsets in it."""
        a, b = self._lanes[c % self.replicas][j]
        pieces, off = [], 0
        for t in own:
            lo, hi = max(a, off), min(b, off + t.numel())
            if lo < hi:
                pieces.append((lo - a, t[lo - off:hi - off]))
            off += t.numel()
            if off >= b:
                break
        return pieces

    def _settle(self, lane: torch.Tensor) -> list[memoryview] | None:
        """A lane this member summed becomes the group's mean (one division, by the member
        that summed it, as one process divides the sum); under a lossy codec, the mean as
        the others will decode it (coded here once, and sent as coded), so every member
        holds the same bytes: data parallel's replicas stay one model."""
        lane.div_(self.mean_of)
        if self.codec.exact or lane.numel() == 0:
            return None
        bufs = self.codec.encode(lane)
        lane.copy_(self.codec.decode(bytearray().join(bufs), tuple(lane.shape), lane.device))
        return bufs

    @property
    def mean_of(self) -> int:
        """The count the group's sum is divided by (see ``divisor``)."""
        return self.replicas if self.divisor is None else self.divisor

    def divide_alone(self) -> None:
        """A group of one member under a layout: its sum (its own gradients, over the
        micro-batches of several shares) still becomes the mean over the shares."""
        if self.mean_of != 1:
            self.flat.div_(self.mean_of)

    def put_back(self, tensors: Sequence[torch.Tensor]) -> None:
        off = 0
        for t in tensors:
            t.copy_(self.flat[off:off + t.numel()].view_as(t))
            off += t.numel()

    def confirm(self, step: int, timeout: float, word: float = 0.0) -> tuple[int, float, float]:
        return confirm(self.send, self.recv, self.replicas, step, timeout, word)

    def confirm_telling(self, step: int, timeout: float, word: float, own: float
                        ) -> tuple[int, float, float, list[float]]:
        """:meth:`confirm`, each member's ``own`` figure going round with its word: also
        every member's figure, by rank (the same list on every member)."""
        return confirm_telling(self.send, self.recv, self.rank, self.replicas, step, timeout,
                               word, own)

    def close(self) -> None:
        """The run is over (a ring of frames holds nothing beyond its links)."""


def confirm(send: PeerLink | None, recv: PeerLink | None, replicas: int, step: int,
            timeout: float, word: float = 0.0) -> tuple[int, float, float]:
    """Returns once every member of a ring has said it finished this step's operation: each
    sends its own word in the first round and passes on the one it got in each later one, so
    after R-1 rounds each has heard from all. The word is the membership the member has been
    told to move to (its epoch): the largest heard, the same on every member, is where the
    whole group goes after this operation. Returns the bytes sent, the seconds it took and
    that word."""
    sent, seconds, heard, _told = _confirm_round(send, recv, 0, replicas, step, timeout, word,
                                                 None)
    return sent, seconds, heard


def confirm_telling(send: PeerLink | None, recv: PeerLink | None, rank: int, replicas: int,
                    step: int, timeout: float, word: float, own: float
                    ) -> tuple[int, float, float, list[float]]:
    """:func:`confirm` with a second float in each frame: the member's ``own`` figure. As
    each round passes on what it got, round i brings the figure of the member i + 1 places
    back around the ring, so after R-1 rounds every member holds all of them, by rank."""
    return _confirm_round(send, recv, rank, replicas, step, timeout, word, own)


def _confirm_round(send: PeerLink | None, recv: PeerLink | None, rank: int, replicas: int,
                   step: int, timeout: float, word: float, own: float | None
                   ) -> tuple[int, float, float, list[float]]:
    t0 = time.perf_counter()
    sent0 = send.sent if send is not None else 0
    out = torch.tensor([float(word)] if own is None else [float(word), float(own)])
    heard, told = float(word), [0.0] * replicas
    if own is not None:
        # (its own as the others read it: rounded to float32, so every member holds one list)
        told[rank] = float(out[1])
    for i in range(replicas - 1):
        assert send is not None and recv is not None
        send.send_tensor(Kind.SYNC, step, CONFIRM_ROUND + i, out, FP32)
        _, out = recv.recv_tensor(Kind.SYNC, step, CONFIRM_ROUND + i, timeout, None,
                                  tuple(out.shape))
        heard = max(heard, float(out[0]))
        if own is not None:
            told[(rank - 1 - i) % replicas] = float(out[1])
    if send is None:
        return 0, time.perf_counter() - t0, heard, told
    send.flush(timeout)
    return send.sent - sent0, time.perf_counter() - t0, heard, told


def pieces_of(size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the frames a message of ``size`` bytes crosses in (at most
    LANE_BYTES each, so a frame's buffer stays small)."""
    return [(a, min(a + LANE_BYTES, size)) for a in range(0, size, LANE_BYTES)] or [(0, 0)]


def gather_bytes(size: int, replicas: int) -> int:
    """What one member sends in an all-gather of messages of ``size`` bytes (headers
    included): R-1 rounds, each a whole message."""
    return (replicas - 1) * (len(pieces_of(size)) * HEADER_SIZE + size)


def gather_frames(size: int, replicas: int) -> int:
    """The frames one all-gather of messages of ``size`` bytes numbers."""
    return (replicas - 1) * len(pieces_of(size))


def all_gather(send: PeerLink | None, recv: PeerLink | None, rank: int, replicas: int,
               step: int, timeout: float, message: bytes, base: int = 0) -> list[bytes]:
    """Every member's message, by rank, around the ring (each the same length: a sum of
    sparse messages is not sparse, so they are gathered, not reduced). Round i sends what
    came in round i-1 (this member's own first), so each member sends R-1 messages. Its
    frames are numbered from ``base``."""
    got: dict[int, bytes] = {rank: message}
    if replicas > 1:
        assert send is not None and recv is not None
        pieces = pieces_of(len(message))
        out = message
        for i in range(replicas - 1):
            for j, (a, b) in enumerate(pieces):
                send.send_raw(Kind.SYNC, step, base + i * len(pieces) + j, out[a:b])
            came = bytearray()
            for j, (a, b) in enumerate(pieces):
                _, raw = recv.recv(Kind.SYNC, step, base + i * len(pieces) + j, timeout)
                if len(raw) != b - a:
                    raise FrameError(f"message piece {j} of step {step} carries {len(raw)} "
                                     f"bytes, expected {b - a}")
                came += raw
            out = bytes(came)
            got[(rank - 1 - i) % replicas] = out
        send.flush(timeout)
    return [got[r] for r in range(replicas)]
