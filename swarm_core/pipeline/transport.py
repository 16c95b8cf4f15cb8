"""Direct fellow-to-fellow TCP: one full-duplex connection per stage boundary.

Sends never block compute: a sender thread drains a queue (so the next micro-batch's forward
runs while the previous activation is still leaving), applying latency and the tx bucket in
64 KiB chunks. A receiver thread reads frames, checks them and files them by kind; the schedule
then takes exactly the frame it expects or fails with a FrameError.

Waits time out on a link where nothing has moved for the frame timeout. So that a neighbour
that is alive but long busy elsewhere (a checkpoint, its own wait on the stage beyond) is not
taken for a dead one, the sender writes a PULSE on a link it has left idle for ``pulse_s``,
unless its owner is itself waiting on that link: two stages that wait on each other (a schedule
mismatch) then both go quiet and time out, instead of keeping each other waiting for ever. Nor
does it pulse for an owner that has shown no sign of life (``Liveness``) for longer than its
limit: a compute thread stuck in a hung disk or device call lets its neighbours time out. A
pulse we send is not progress on our side: only the peer's bytes, and our data, are.
"""

from __future__ import annotations

import contextlib
import math
import queue
import socket
import struct
import threading
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from swarm_core.pipeline import codecs, handshake
from swarm_core.pipeline.frames import (
    DATA_KINDS,
    DEFAULT_MAX_PAYLOAD,
    FLAG_FAREWELL,
    HEADER_SIZE,
    FrameError,
    FrameHeader,
    Kind,
    check_payload,
    expect,
    make_header,
    pulse_header,
)
from swarm_core.pipeline.links import Shaping

if TYPE_CHECKING:
    from swarm_core.pipeline.boundary import BoundaryCodec


class LinkClosed(ConnectionError):
    # The neighbouring stage at the other end, when known: a failure it likely caused (the
    # leader waits a moment for that stage's own report before it takes this one's word).
    peer_stage: int | None = None


class PeerTimeout(TimeoutError):
    peer_stage: int | None = None


class LinkAborted(Exception):
    """The owner asked to stop; not a fault of the peer."""


def blaming(exc: LinkClosed | PeerTimeout, stage: int | None) -> LinkClosed | PeerTimeout:
    """``exc``, marked as pointing at neighbouring stage ``stage``."""
    exc.peer_stage = stage
    return exc


class Liveness:
    """When the owner (a stage's compute thread) last showed progress: each op it runs and each
    poll of a wait touches it. Its links pulse only while it is fresher than ``limit_s``."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.at = time.monotonic()

    def touch(self) -> None:
        self.at = time.monotonic()

    def fresh(self) -> bool:
        return time.monotonic() - self.at < self.limit_s


_CLOSED = object()
_FAREWELL = object()
_F64 = struct.Struct("<d")


CLOSE_JOIN_S = 2.0  # how long close() waits for each of a link's threads to end
# How long farewell() waits for a FAREWELL pulse to leave: behind a frame already being
# written (dropping it mid-frame would corrupt the stream), so while that frame's bytes keep
# moving, up to FAREWELL_LIMIT_S; a link on which nothing moved for FAREWELL_QUIET_S is closed
# without one (its peer then takes the close for a death).
FAREWELL_QUIET_S = 1.0
FAREWELL_LIMIT_S = 30.0
# How long a flush waits for the sender to finish its frames once the link failed (see
# PeerLink._settle_failure).
SETTLE_S = 1.0


class PeerLink:
    """Frames to and from one neighbouring stage over one TCP connection."""

    def __init__(self, sock: socket.socket, shaper: Shaping, job: int, peer: str,
                 max_payload: int = DEFAULT_MAX_PAYLOAD,
                 abort: threading.Event | None = None,
                 receives: Collection[Kind] = DATA_KINDS,
                 pulse_s: float | None = None, liveness: Liveness | None = None,
                 peer_stage: int | None = None) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.shaper = shaper
        self.job = job
        self.peer = peer
        self.peer_stage = peer_stage
        # The largest payload a frame from this peer may claim (its buffer is allocated from
        # the header's length before a byte of it arrives), and the kinds it may send: any
        # other frame fails the link at once, rather than waiting in a queue nobody reads.
        self.max_payload = max_payload
        self.receives = frozenset(receives)
        self._out: queue.Queue[Any] = queue.Queue()
        self._in: dict[Kind, queue.Queue[Any]] = {k: queue.Queue() for k in Kind}
        # Where a frame's payload is to be read straight into (see land), by (kind, step,
        # micro-batch): written by the owner, taken by the receiver thread.
        self._landing: dict[tuple[Kind, int, int], memoryview] = {}
        self.landed = 0  # frames read into a landing
        self.sent = 0  # data bytes this link put on the wire (the shaper counts the whole fellow)
        # Data bytes its owner gave it to send: a step's own bytes, whenever they leave (a
        # frame still crossing after ``flush(in_flight=True)`` is written in the next step).
        self.queued = 0
        self.peer_closed = False  # the far end closed it (its process ended, or it let go)
        # It said FAREWELL first: it let go (its cell regroups), its process did not end.
        self.peer_left = False
        self.pulse_bytes = 0  # and its pulses' (not data: kept out of the per-step wire bytes)
        # Seconds the owner spent blocked in recv and flush: time it could have computed had
        # the network and the neighbour been instant (the stage reports it per step).
        self.waited = 0.0
        self._stop = threading.Event()
        # Set by the owner (STOP from the leader): a blocked recv gives up within 0.1 s.
        self.abort = abort or threading.Event()
        # When bytes last moved either way: waits time out on a link gone quiet, not on one
        # still carrying a long transfer (m frames at 8 Mbit/s can outlast any fixed wait).
        self.last_progress = time.monotonic()
        # ``pulse_s``: seconds this side may leave the link idle before a PULSE (None: never).
        self.pulse_s = pulse_s
        self.liveness = liveness
        self._pulse_header = pulse_header(job)
        self._pulse = self._pulse_header.pack()
        self._farewell_header = pulse_header(job, FLAG_FAREWELL)
        self._farewell_sent = threading.Event()
        self._farewell_queued = 0.0  # when farewell() queued the pulse (see farewell_written)
        self._last_write = self.last_progress
        self._owner_waiting = False  # in recv or flush on this link: no pulses then
        # The frame the sender holds (held back for the added latency, or being written):
        # when it was queued, its due time, its bytes, and when the frames before it would
        # have left a real link (see _only_in_flight); None while it holds none.
        self._holding: tuple[float, float, int, float] | None = None
        self._real_left = -math.inf  # when the frames the sender took would have left
        self._error: BaseException | None = None
        self._send_failed = False  # the sender's own write failed (not only the receiver)
        self._sender = threading.Thread(target=self._send_loop, name=f"tx-{peer}", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"rx-{peer}",
                                          daemon=True)
        self._sender.start()
        self._receiver.start()

    # sending ---------------------------------------------------------------------------------
    def send_tensor(self, kind: Kind, step: int, micro_batch: int, x: torch.Tensor,
                    codec: BoundaryCodec = codecs.FP32_WIRE, flags: int = 0) -> int:
        """Queue a tensor; returns the bytes it will put on the wire (header included). The
        codec's scale block goes in the header, for the receiver's decode; a codec that
        draws keys its draws by the micro-batch's slot and the step (a stage's frames say
        their place in the whole batch: ``StageRunner._send``)."""
        return self.send_coded(kind, step, micro_batch, tuple(x.shape), codec.wire,
                               codec.encode(x, micro_batch, step), x, flags)

    def send_coded(self, kind: Kind, step: int, micro_batch: int, shape: tuple[int, ...],
                   codec: codecs.WireCodec, bufs: list[memoryview], keep: object,
                   flags: int = 0) -> int:
        """Queue a tensor of ``shape`` already coded (``bufs``, as ``codec.encode`` gives
        them: a sender that keeps what the receiver will decode codes it once); ``keep``
        holds the memory ``bufs`` view until they are written."""
        header = make_header(kind, self.job, step, micro_batch, shape, int(codec.codec), bufs,
                             flags=flags, codec_arg=codec.block)
        return self._queue(header, bufs, keep)

    def send_raw(self, kind: Kind, step: int, micro_batch: int, payload: bytes) -> None:
        header = make_header(kind, self.job, step, micro_batch, (len(payload),), 0, payload)
        self._queue(header, [memoryview(payload)], None)

    def _queue(self, header: FrameHeader, bufs: list[memoryview], keep: object) -> int:
        """A frame for the sender: due its added latency from now (the queue's items are
        (due, head, bufs, keep, queued at, bytes)); returns its bytes."""
        now, size = time.monotonic(), HEADER_SIZE + header.payload_len
        self._out.put((now + self.shaper.latency_s, header.pack(), bufs, keep, now, size))
        self.queued += size
        return size

    def flush(self, timeout: float, in_flight: bool = False) -> None:
        """Wait until everything queued has been written (``timeout``: seconds without any
        progress on the link). With ``in_flight``, until every frame not yet written would
        have left a real link by now, only crossing its latency (the emulation holds a frame
        its latency at the sender, then writes it at the link's rate): a real sender does not
        wait while its bytes cross, so a step that ends on a frame (clipping's norm total) is
        not made a latency longer; those frames go out at their time, in order. Not before a
        close: a closing link drops what it has not written."""
        start = time.monotonic()
        self._owner_waiting = True
        try:
            while self._out.unfinished_tasks and not (in_flight and self._only_in_flight()):
                if self.liveness is not None:
                    self.liveness.touch()
                if self._error is not None:
                    self._settle_failure()
                    continue
                if self.abort.is_set():
                    raise LinkAborted("stopped while sending to the peer")
                if self._quiet_for(start) > timeout:
                    raise self._blame(PeerTimeout(f"sending to {self.peer}: nothing moved for "
                                                  f"{timeout:g}s"))
                # Woken as the sender marks the last frame written (not a poll: a flush
                # between the rounds of a ring returns as soon as its chunk has left); the
                # checks above run again every 10 ms meanwhile.
                with self._out.all_tasks_done:
                    if self._out.unfinished_tasks:
                        self._out.all_tasks_done.wait(0.01)
            if self._send_failed:
                self._raise_if_failed()
        finally:
            self._owner_waiting = False
            self.waited += time.monotonic() - start

    def _only_in_flight(self) -> bool:
        """Whether every frame not yet written would have left a real link by now: on a real
        link a frame leaves at the link's rate from when it was sent (or when the frame
        before it had left, written or not) and crosses its latency after; the emulation
        holds it the latency first. Not where no latency was added (what is queued then is
        only waiting to be written)."""
        now = time.monotonic()
        with self._out.mutex:  # (the queue as it stands; the sender takes and ends under it)
            holding = self._holding
            left = holding[3] if holding is not None else self._real_left
            queued = list(self._out.queue)
            unfinished = self._out.unfinished_tasks
        # (an item the sender took and has not yet marked held is in neither count: wait)
        if unfinished != len(queued) + (holding is not None) \
                or not all(isinstance(item, tuple) for item in queued):
            return False
        frames = ([holding[:3]] if holding is not None else []) + [
            (item[4], item[0], item[5]) for item in queued]
        for queued_at, due, size in frames:
            if due <= queued_at:
                return False
            left = max(queued_at, left) + self._seconds_at_rate(size)
        return left <= now

    def _seconds_at_rate(self, size: int) -> float:
        """Seconds ``size`` bytes take at the link's tx rate (0 unlimited)."""
        mbps = self.shaper.tx.mbps
        return size * 8 / (mbps * 1e6) if mbps else 0.0

    def _settle_failure(self) -> None:
        """The link failed while frames were queued. A peer that got everything may close it
        at once (its run is over) while our sender, descheduled on a busy machine, has yet to
        mark its last frame written: that close is no failure of ours. So give the sender a
        moment to finish; raise if it did not, or if its own write failed."""
        deadline = time.monotonic() + SETTLE_S
        while self._out.unfinished_tasks and time.monotonic() < deadline \
                and not self._send_failed:
            time.sleep(0.002)
        if self._send_failed or self._out.unfinished_tasks:
            self._raise_if_failed()

    def _quiet_for(self, since: float) -> float:
        return time.monotonic() - max(since, self.last_progress)

    def _halted(self) -> bool:
        return self._stop.is_set() or self.abort.is_set()

    def _send_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._out.get(timeout=self._until_pulse())
                except queue.Empty:
                    self._send_pulse()
                    continue
                try:
                    if item is _CLOSED:
                        return
                    if self.abort.is_set():
                        continue  # stopping: what is queued is dropped, not sent
                    if item is _FAREWELL:
                        self._write(memoryview(self._farewell_header.pack()), pulse=True)
                        self._farewell_sent.set()
                        continue
                    due, head, bufs, _keepalive, queued_at, size = item
                    before = self._real_left
                    self._real_left = max(queued_at, before) + self._seconds_at_rate(size)
                    self._holding = (queued_at, due, size, before)
                    if self._sleep_until(due):
                        continue
                    began = time.monotonic()
                    written = self._write_frame(head, bufs)
                    # (the rate a frame achieved: its bytes over its time on the wire, waits
                    # on the buckets included, the added latency not)
                    self.shaper.count_frame(written, time.monotonic() - began)
                except OSError as exc:
                    # Failed before the frame counts as done: a flush never takes it for written.
                    self._send_failed = True
                    self._fail(self._blame(LinkClosed(
                        f"link to {self.peer} broke while sending: {exc}")))
                    return
                except Exception as exc:
                    self._send_failed = True
                    self._fail(LinkClosed(f"link to {self.peer} failed while sending: {exc!r}"))
                    return
                finally:
                    self._holding = None
                    self._out.task_done()
        except OSError as exc:  # (a pulse)
            self._send_failed = True
            self._fail(self._blame(LinkClosed(f"link to {self.peer} broke while sending: {exc}")))
        except Exception as exc:  # a bug or MemoryError: the stage must hear of it now
            self._send_failed = True
            self._fail(LinkClosed(f"link to {self.peer} failed while sending: {exc!r}"))

    def _write_frame(self, head: bytes, bufs: list[memoryview]) -> int:
        """One frame onto the wire; returns the bytes written."""
        size = len(head)
        self._write(memoryview(head))
        for b in bufs:
            off = 0
            while off < len(b) and not self.abort.is_set():
                step = self.shaper.tx.chunk()  # (a set-speed applies mid-frame)
                self._write(b[off:off + step])
                off += step
            size += off
        return size

    def _sleep_until(self, due: float) -> bool:
        """The added latency: sleep until ``due``, or until the owner stops or closes the link
        (True: then the frame is dropped)."""
        while (left := due - time.monotonic()) > 0:
            if self.abort.wait(min(left, 0.05)) or self._stop.is_set():
                return True
        return False

    def _until_pulse(self) -> float | None:
        if self.pulse_s is None:
            return None
        # A pulse held back (by the owner's wait, say) is looked at again an eighth later.
        return max(self.pulse_s / 8, 0.01, self._last_write + self.pulse_s - time.monotonic())

    def _send_pulse(self) -> None:
        assert self.pulse_s is not None
        if self._halted() or self._error is not None or self._owner_waiting \
                or (self.liveness is not None and not self.liveness.fresh()) \
                or time.monotonic() - self._last_write < self.pulse_s:
            return
        self._write(memoryview(self._pulse), pulse=True)

    def _write(self, chunk: memoryview, pulse: bool = False) -> None:
        self.shaper.tx.consume(len(chunk), self._halted)
        self.sock.sendall(chunk)
        self._wrote(len(chunk), pulse)

    def _wrote(self, n: int, pulse: bool = False) -> None:
        """``n`` bytes left: counted on the shaper and the link (a pulse's apart from data's,
        and not as progress)."""
        self.shaper.count_tx(n)
        self._last_write = time.monotonic()
        if pulse:
            self.pulse_bytes += n
        else:
            self.sent += n
            self.last_progress = self._last_write

    # receiving -------------------------------------------------------------------------------
    def land(self, kind: Kind, step: int, into: dict[int, memoryview]) -> None:
        """Read the payloads of step ``step``'s frames of ``kind`` straight into ``into``
        (by micro-batch), each if it has exactly that length and has not begun to arrive:
        ``recv`` then returns that memoryview as the payload. Saves a buffer allocated,
        faulted in and copied out of for each frame of megabytes (a ring's chunks). Each
        must not be in use from when its frame may arrive. The landings of earlier steps
        still set (a frame that came before its landing, or never came) are dropped."""
        # (a snapshot: the receiver thread takes landings meanwhile)
        for key in [k for k in list(self._landing) if k[1] < step]:
            self._landing.pop(key, None)
        self._landing.update({(kind, step, mb): view for mb, view in into.items()})

    def _read_header(self) -> bytearray:
        return self._read_exact(HEADER_SIZE)

    def _read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return buf

    def _read_into(self, view: memoryview) -> None:
        n = len(view)
        got = 0
        while got < n:
            want = min(self.shaper.rx.chunk(), n - got)
            r = self.sock.recv_into(view[got:got + want], want)
            if r == 0:
                if not self._stop.is_set():  # (not our own close)
                    self.peer_closed = True
                raise LinkClosed(f"{self.peer} closed the link")
            got += r
            self.last_progress = time.monotonic()
            self.shaper.count_rx(r)
            # Charged for what arrived (TCP often returns less than asked), after the fact:
            # the bucket's debt then holds the next read back.
            self.shaper.rx.consume(r, self._halted)

    def _recv_loop(self) -> None:
        try:
            while not self._stop.is_set():
                header = FrameHeader.unpack(self._read_header(), self.max_payload)
                if header.job != self.job:
                    raise FrameError(f"frame for another job from {self.peer} (tag "
                                     f"{header.job:#x}, expected {self.job:#x})")
                if header.kind is Kind.PULSE:
                    if header == self._farewell_header:
                        self.peer_left = True  # (the close that follows is no death)
                    elif header != self._pulse_header:
                        raise FrameError(f"PULSE frame from {self.peer} is not the empty "
                                         f"frame a pulse is")
                    continue  # its bytes were the progress
                if header.kind not in self.receives:
                    carried = "/".join(k.name for k in sorted(self.receives))
                    raise FrameError(f"unexpected {header.kind.name} frame from {self.peer} "
                                     f"(this link carries {carried})")
                into = self._landing.pop((header.kind, header.step, header.micro_batch), None)
                payload: bytearray | memoryview
                if into is not None and len(into) == header.payload_len:
                    self._read_into(into)
                    payload = into
                    self.landed += 1
                else:
                    payload = self._read_exact(header.payload_len)
                check_payload(header, payload)
                self._in[header.kind].put((header, payload))
        except (FrameError, LinkClosed, OSError) as exc:
            if not self._stop.is_set():
                # The peer closed or broke the link: a failure that points at it. (A FrameError
                # is the reason itself; a bug of ours below points at nobody.)
                err = exc if isinstance(exc, FrameError) else self._blame(
                    exc if isinstance(exc, LinkClosed) else
                    LinkClosed(f"link to {self.peer} broke: {exc}"))
                self._fail(err)
        except Exception as exc:  # a bug or MemoryError: the stage must hear of it now
            self._fail(LinkClosed(f"link to {self.peer} failed while receiving: {exc!r}"))

    def _blame(self, exc: LinkClosed | PeerTimeout) -> LinkClosed | PeerTimeout:
        return blaming(exc, self.peer_stage)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        for q in self._in.values():
            q.put(_CLOSED)
        # The socket stays open until our stage raises the error and closes its links: were it
        # shut here, the peer's "closed the link" would reach the leader before our reason.

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def ready(self, kind: Kind) -> bool:
        """Whether a ``recv`` of ``kind`` would return (or raise) without waiting."""
        return not self._in[kind].empty()

    def recv(self, kind: Kind, step: int, micro_batch: int, timeout: float,
             flags: int = 0) -> tuple[FrameHeader, bytearray | memoryview]:
        """The next frame of ``kind``, which must be for ``step`` and ``micro_batch``.
        ``timeout``: seconds with no byte moving on the link either way."""
        start = time.monotonic()
        self._owner_waiting = True
        try:
            while True:
                if self.liveness is not None:
                    self.liveness.touch()
                if self.abort.is_set():
                    raise LinkAborted("stopped while waiting for the peer")
                if self._quiet_for(start) > timeout:
                    exc = self._blame(PeerTimeout(
                        f"no {kind.name} step {step} micro-batch {micro_batch} from "
                        f"{self.peer}: nothing moved for {timeout:g}s"))
                    # Given up on, the link must stop pulsing (set while the owner still counts
                    # as waiting, so no pulse slips in): else the peer, waiting on us in turn,
                    # would be kept alive by a side that has already failed.
                    self._fail(exc)
                    raise exc
                try:
                    item = self._in[kind].get(timeout=0.1)
                    break
                except queue.Empty:
                    continue
        finally:
            self._owner_waiting = False
            self.waited += time.monotonic() - start
        if item is _CLOSED:
            self._in[kind].put(_CLOSED)
            self._raise_if_failed()
            raise self._blame(LinkClosed(f"link to {self.peer} closed"))
        header, payload = item
        expect(header, kind, self.job, step, micro_batch, flags)
        return header, payload

    def recv_tensor(self, kind: Kind, step: int, micro_batch: int, timeout: float,
                    device: torch.device | None = None,
                    shape: tuple[int, ...] | None = None,
                    flags: int = 0, codec: BoundaryCodec | None = None,
                    ) -> tuple[FrameHeader, torch.Tensor]:
        """The next frame's tensor, decoded onto ``device`` (the CPU by default); with
        ``shape``, a frame of any other shape is an error, not a tensor to train on. With
        ``codec`` (a stage's side of a boundary) it decodes, by the micro-batch's slot, and a
        frame coded otherwise is an error; without, the header says how."""
        header, payload = self.recv(kind, step, micro_batch, timeout, flags)
        if shape is not None and tuple(header.shape) != tuple(shape):
            raise FrameError(f"{kind.name} step {step} micro-batch {micro_batch} from "
                             f"{self.peer} has shape {list(header.shape)}, expected "
                             f"{list(shape)}")
        try:
            said = codecs.WireCodec(codecs.Codec(header.codec), header.codec_arg)
        except ValueError:
            raise FrameError(f"unknown codec {header.codec}") from None
        if codec is not None and said != codec.wire:
            raise FrameError(f"{kind.name} step {step} micro-batch {micro_batch} from "
                             f"{self.peer} is coded {said.codec.name} block {said.block}, "
                             f"expected {codec.wire.codec.name} block {codec.wire.block}")
        try:
            return header, (codec or said).decode(payload, header.shape, device, micro_batch)
        except codecs.CodecError as exc:
            raise FrameError(f"{kind.name} step {step} micro-batch {micro_batch} from "
                             f"{self.peer}: {exc}") from None

    def recv_float(self, kind: Kind, step: int, micro_batch: int, timeout: float) -> float:
        """A frame that carries one float64."""
        return self.recv_floats(kind, step, micro_batch, timeout, 1)[0]

    def send_float(self, kind: Kind, step: int, micro_batch: int, value: float) -> None:
        self.send_floats(kind, step, micro_batch, (value,))

    def recv_floats(self, kind: Kind, step: int, micro_batch: int, timeout: float,
                    count: int) -> list[float]:
        """A frame that carries ``count`` float64s (the chain's norm exchange, and measured
        routes' table along it)."""
        _, raw = self.recv(kind, step, micro_batch, timeout)
        if len(raw) != count * _F64.size:
            raise FrameError(f"{kind.name} step {step} from {self.peer} carries {len(raw)} "
                             f"bytes, expected {count * _F64.size}")
        return list(struct.unpack(f"<{count}d", raw))

    def send_floats(self, kind: Kind, step: int, micro_batch: int,
                    values: Sequence[float]) -> None:
        self.send_raw(kind, step, micro_batch, struct.pack(f"<{len(values)}d", *values))

    @property
    def died(self) -> bool:
        """Whether the far end closed the link without a FAREWELL: its process likely ended
        (a peer that lets go to regroup says so first)."""
        return self.peer_closed and not self.peer_left

    def farewell(self) -> None:
        """Make a FAREWELL pulse the link's next frame, ahead of a close of this side's own
        will (see :func:`farewell`): frames queued and not yet being written are dropped
        (they belong to the operation that broke; a shaped link's close drops them too, and
        a torch link's would send them first), the one being written goes out whole. A link
        this side can still write to says it, whatever failed its receiving side (a wait
        that timed out is no reason to be taken for dead)."""
        if self._halted() or self._send_failed or self.peer_closed:
            return
        self._farewell_sent.clear()
        # (the quiet a farewell_written allows counts from here: a link left idle before it
        # would otherwise be closed at once, racing the sender thread that writes it)
        self._farewell_queued = time.monotonic()
        while True:
            try:
                self._out.get_nowait()
            except queue.Empty:
                break
            self._out.task_done()
        self._out.put(_FAREWELL)

    def farewell_written(self, deadline: float, quiet_s: float = FAREWELL_QUIET_S) -> bool:
        """Wait for the FAREWELL to be written: while bytes keep leaving (a frame ahead of
        it), until ``deadline``, or until nothing has left for ``quiet_s``. Whether it was
        (never raises: the link is about to close)."""
        while not self._farewell_sent.is_set() and not self._send_failed \
                and not self._halted():
            now = time.monotonic()
            # (a frame ahead of it may be held for the link's added latency first)
            quiet = quiet_s + self.shaper.latency_s
            if now >= deadline or now - max(self._last_write, self._farewell_queued) > quiet:
                break
            self._farewell_sent.wait(0.005)
        return self._farewell_sent.is_set()

    def close(self) -> None:
        self._stop.set()
        self._out.put(_CLOSED)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        # Both threads end on the closed socket; waiting for them means none is still in
        # native code when the interpreter exits (a daemon thread unwound there aborts it).
        for t in (self._sender, self._receiver):
            if t is not threading.current_thread():
                t.join(CLOSE_JOIN_S)


def farewell(links: Collection[PeerLink], limit_s: float = FAREWELL_LIMIT_S) -> None:
    """Tell each peer that the close to come is this side letting go, not dying (a cell
    about to regroup): a FAREWELL pulse queued on every link, then a wait for them all to
    leave (``PeerLink.farewell_written``, ``limit_s`` at most). A peer that reads it does not
    name this cell as the one that died (``PeerLink.died``)."""
    for link in links:
        link.farewell()
    deadline = time.monotonic() + limit_s
    for link in links:
        link.farewell_written(deadline)


# --- connection setup -----------------------------------------------------------------------


def connect(addr: str, key: str, stage: int, job: int, shaper: Shaping,
            timeout: float, abort: threading.Event | None = None,
            max_payload: int = DEFAULT_MAX_PAYLOAD,
            receives: Collection[Kind] = DATA_KINDS,
            pulse_s: float | None = None, liveness: Liveness | None = None,
            ring: tuple[int, int] | None = None,
            route: tuple[int, int] | None = None, transport: str = "shaped") -> PeerLink:
    """Dial the downstream neighbour at ``host:port``, and prove the job's session key to it
    as it proves it back (``handshake``); with ``ring`` (this replica, the next one) the next
    replica of this stage on its group's ring; with ``route`` (this replica, the one dialled)
    a replica of the next stage other than its own chain's (swarm wiring). A connection the
    listener drops before the handshake completes (it was busy, or not yet listening for this
    job) is dialled again until ``timeout``; a listener that answers without the key is an
    impostor: refused. ``transport``: see :func:`make_link`."""
    peer_stage = stage if ring else stage + 1
    peer = f"stage {stage} replica {ring[1]}" if ring else \
        f"stage {stage + 1} replica {route[1]}" if route else f"stage {stage + 1}"
    host, _, port = addr.rpartition(":")
    caller = handshake.who(stage, ring[0] if ring else route[0] if route else None,
                           route=route is not None)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        if abort is not None and abort.is_set():
            raise LinkAborted("stopped while connecting")
        if time.monotonic() > deadline:
            raise blaming(PeerTimeout(f"cannot connect to {peer} at {addr}: {last}"),
                          peer_stage)
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
        except OSError as exc:
            last = exc
            time.sleep(0.1)
            continue
        try:
            handshake.dial(sock, key, job, caller, deadline, abort)
        except handshake.HandshakeError as exc:
            sock.close()
            if exc.proof:
                raise blaming(LinkClosed(f"{peer} at {addr} refused: {exc}"),
                              peer_stage) from None
            last = exc
            time.sleep(0.1)
            continue
        except BaseException:
            sock.close()
            raise
        try:
            sock.settimeout(None)
            return make_link(transport, sock, False, caller, deadline - time.monotonic(),
                             shaper=shaper, job=job, peer=f"{peer} ({addr})", abort=abort,
                             max_payload=max_payload, receives=receives, pulse_s=pulse_s,
                             liveness=liveness, peer_stage=peer_stage)
        except BaseException:
            sock.close()
            raise


def make_link(transport: str, sock: socket.socket, listening: bool, who: bytes,
              timeout: float, **kwargs: Any) -> PeerLink:
    """The link over a proven connection: its frames on the socket itself (``shaped``), or
    on a two-rank torch.distributed group met through it (``torch``, see torch_link)."""
    if transport == "shaped":
        return PeerLink(sock, **kwargs)
    from swarm_core.pipeline import torch_link  # (torch.distributed only where asked for)

    try:
        group, store = torch_link.rendezvous(sock, listening, kwargs["job"], who,
                                             max(timeout, 1.0))
    except (OSError, RuntimeError) as exc:
        raise blaming(LinkClosed(f"torch rendezvous with {kwargs['peer']} failed: "
                                 f"{torch_link.gloo_reason(exc)}"),
                      kwargs.get("peer_stage")) from None
    return torch_link.TorchLink(sock, group, store, **kwargs)
