"""``transport: torch``: a link's frames over a two-rank torch.distributed process group.

The link is set up as the shaped one is (the data listener, the handshake that proves the
job's key both ways), then moves its frames onto a gloo process group of its two ends: the
listening end hosts a ``TCPStore`` on a fresh port of the address it was reached on and tells
the dialler that port over the proven connection; both build the group under a prefix of the
link's job tag (each membership epoch's ring has a tag of its own) and the dialler's name.
A frame is point-to-point messages (``send``/``recv``, not ``batch_isend_irecv``, which
hangs on gloo: pytorch/pytorch#132644): a slot of fixed size with its header, and its payload
in the slot where it fits, else as a second message; so the frames' meaning, checks, codecs
and byte counters are those of the shaped link.

Unshaped: gloo's sockets are not the app's, so no token bucket or added latency applies (a
job on this transport is marked so, and set-speed on it refuses). A gloo receive cannot be
interrupted from its own side, and a timed-out one closes the pair, so the receiver waits
with a long timeout and closing is a handshake of its own: each end sends BYE (a slot of
zeros, never a valid header) as it closes, which ends the peer's receive as a
closed TCP connection would; a peer that dies closes the pair, which ends it too.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import re
import socket
import struct
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from swarm_core.pipeline.frames import HEADER_SIZE, FrameHeader
from swarm_core.pipeline.transport import _CLOSED, CLOSE_JOIN_S, LinkClosed, PeerLink

TRANSPORTS = ("shaped", "torch")
# Every frame's first message is SLOT bytes: its header, then its payload where that fits
# (a pulse, a norm, a confirmation, a ring's small lanes), zeros after. The receiver posts that
# receive ahead of time, so a small frame crosses as one message instead of two, the second
# posted only once the header is in (a gloo send waits for its receive: a round trip).
INLINE = 192
SLOT = HEADER_SIZE + INLINE
BYE = bytes(SLOT)
_PORT = struct.Struct("!H")
# A receive waits for the next frame however long a neighbour is busy elsewhere: the owner's
# own waits time out (see PeerLink.recv), and a dead peer closes the pair at once.
IDLE_TIMEOUT = datetime.timedelta(hours=24)
BYE_WAIT_S = 1.0  # how long a closing end waits for the peer to take its BYE


def _slot(head: bytes, bufs: list[memoryview] | None = None) -> bytearray:
    """A frame's first message: its header, the payload where it fits, zeros to SLOT."""
    slot = bytearray(SLOT)
    slot[:len(head)] = head
    off = len(head)
    for b in bufs or ():
        slot[off:off + b.nbytes] = b
        off += b.nbytes
    return slot


def _payload(bufs: list[memoryview]) -> bytearray | memoryview:
    """A payload after its slot, as one message: the receiver posts one receive of the
    header's length (the header does not say where a codec's buffers part), so several are
    joined. A single writable buffer (a codec's tensor bytes) goes as it is, saving a copy
    of megabytes a frame; a read-only one (``send_raw``'s bytes) is copied: ``torch.frombuffer``
    warns on it, which ``-W error`` would turn into a failed send."""
    if len(bufs) == 1 and not bufs[0].readonly and bufs[0].c_contiguous:
        return bufs[0]
    return bytearray().join(bufs)


def gloo_reason(exc: BaseException) -> str:
    """gloo's error in a line: its first sentence, without the source path before it
    ("[.../pair.cc:553] Connection closed by peer [127.0.0.1]:44764. This is typically...")."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ", 1)[0].rstrip(".")


def gloo_group(store: dist.Store, prefix: str, host: str, rank: int, size: int,
               timeout: datetime.timedelta) -> Any:
    """A gloo group of ``size`` under ``prefix`` of ``store``, listening on ``host`` only."""
    opts = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 (private in the stubs)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("the peer closed the link during the torch rendezvous")
        buf += got
    return buf


def rendezvous(sock: socket.socket, listening: bool, job: int, who: bytes,
               timeout: float) -> tuple[Any, Any]:
    """The two-rank group of a proven connection, and its store. Gloo
    listens where the data listener was reached (loopback stays loopback)."""
    deadline = time.monotonic() + timeout
    wait = datetime.timedelta(seconds=max(1.0, timeout))
    prefix = f"{job:x}/{who.hex()}"
    host = sock.getsockname()[0]
    if listening:
        store, port = hosted_store(host, sock.family, wait)
        sock.sendall(_PORT.pack(port))
        return gloo_group(store, prefix, host, 0, 2, IDLE_TIMEOUT), store
    (port,) = _PORT.unpack(_read(sock, _PORT.size, deadline))
    store = dist.TCPStore(sock.getpeername()[0], port, is_master=False, timeout=wait)
    return gloo_group(store, prefix, host, 1, 2, IDLE_TIMEOUT), store


def hosted_store(host: str, family: socket.AddressFamily,
                 timeout: datetime.timedelta) -> tuple[Any, int]:
    """A ``TCPStore`` served on a fresh port of ``host`` (a socket bound here: TCPStore's own
    would listen on every interface; the store owns it and closes it as it ends), and the
    port."""
    server = socket.socket(family, socket.SOCK_STREAM)
    server.bind((host, 0))
    server.listen(16)
    port = server.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=server.detach()), port


# Links closed with their receiver still waiting for the peer's BYE. A receiver that returns
# from gloo while the interpreter shuts down is unwound through C++ frames, which aborts the
# process: at exit each gets a moment to end first (one blocked for good stays blocked,
# which is safe).
_CLOSED_WAITING: weakref.WeakSet[TorchLink] = weakref.WeakSet()
EXIT_JOIN_S = 1.0


@atexit.register
def _let_receivers_end() -> None:
    deadline = time.monotonic() + EXIT_JOIN_S
    for link in list(_CLOSED_WAITING):
        link._receiver.join(max(0.0, deadline - time.monotonic()))


class TorchLink(PeerLink):
    """A :class:`PeerLink` whose frames cross a two-rank gloo group (see the module)."""

    def __init__(self, sock: socket.socket, group: Any, store: Any, **kwargs: Any) -> None:
        # (set before the base starts the link's threads, which use them)
        self.group, self._store = group, store
        self._peer_rank = 1 - group.rank()
        self._closing = False
        self._pair_lost = False  # gloo's pair closed: the peer's process let go of its group
        self._inline: memoryview | None = None  # the payload that came in the header's slot
        super().__init__(sock, **kwargs)

    # the wire --------------------------------------------------------------------------------
    def _write_frame(self, head: bytes, bufs: list[memoryview]) -> int:
        n = sum(b.nbytes for b in bufs)
        if n <= INLINE:
            self._send(_slot(head, bufs))
        else:
            self._send(_slot(head))
            self._send(_payload(bufs))
        # (the frame's bytes, as a shaped link counts them: not the slot's zeros)
        size = len(head) + n
        self._wrote(size)
        return size

    def _write(self, chunk: memoryview, pulse: bool = False) -> None:
        """A pulse (the only whole frame the base writes itself): one slot."""
        self._send(_slot(bytes(chunk)))
        self._wrote(len(chunk), pulse)

    def _send(self, data: bytearray | memoryview) -> None:
        try:
            self.group.send([torch.frombuffer(data, dtype=torch.uint8)], self._peer_rank,
                            0).wait()
        except RuntimeError as exc:  # (gloo's: the pair closed, the peer is gone)
            raise ConnectionError(f"gloo: {gloo_reason(exc)}") from None

    def _read_header(self) -> bytearray:
        slot = bytearray(SLOT)
        self._recv(memoryview(slot))
        if slot == BYE:
            self.peer_closed = True
            raise LinkClosed(f"{self.peer} closed the link")
        head = slot[:HEADER_SIZE]
        n = FrameHeader.unpack(head, self.max_payload).payload_len
        self._inline = memoryview(slot)[HEADER_SIZE:HEADER_SIZE + n] if n <= INLINE else None
        self.shaper.count_rx(HEADER_SIZE)
        return head

    def _read_into(self, view: memoryview) -> None:
        """The frame's payload: from its slot where it came inline, else its own message."""
        inline, self._inline = self._inline, None
        if inline is not None:
            view[:] = inline
            self.shaper.count_rx(len(view))
        elif len(view):
            self._recv(view)
            self.shaper.count_rx(len(view))

    def _recv(self, view: memoryview) -> None:
        try:
            self.group.recv([torch.frombuffer(view, dtype=torch.uint8)], self._peer_rank,
                            0).wait()
        except RuntimeError as exc:
            self._pair_lost = True
            if not self._stop.is_set():
                self.peer_closed = True
            raise LinkClosed(f"{self.peer} closed the link (gloo: {gloo_reason(exc)})") \
                from None
        self.last_progress = time.monotonic()

    def _sleep_until(self, due: float) -> bool:
        return self._halted()  # (unshaped: no latency is added)

    def _only_in_flight(self) -> bool:
        return False  # (gloo's sends are not the shaper's: a flush waits for them all)

    # closing ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Let the sender finish what is queued (dropped if stopping), say BYE unless the peer
        is gone, then stop. The receiver ends on the peer's BYE or its death; neither it nor a
        BYE the peer does not take (its receiver has already ended) is waited for beyond a
        moment: both end when the peer's process lets go of its group."""
        if self._closing:
            return
        self._closing = True
        self._out.put(_CLOSED)
        if self._sender is not threading.current_thread():
            self._sender.join(CLOSE_JOIN_S)
        if not self._sender.is_alive() and not self._send_failed and not self._pair_lost:
            bye = threading.Thread(target=self._say_bye, name=f"bye-{self.peer}", daemon=True)
            bye.start()
            bye.join(BYE_WAIT_S)
        self._stop.set()
        if self._receiver is not threading.current_thread():
            self._receiver.join(0.2)
        if self._receiver.is_alive():
            _CLOSED_WAITING.add(self)
        with contextlib.suppress(OSError):
            self.sock.close()

    def _say_bye(self) -> None:
        with contextlib.suppress(ConnectionError):
            self._send(bytearray(BYE))
