"""The data plane's handshake: both ends prove they hold the job's session key, neither sends it.

Three HELLO frames (frame version 6)::

    dialer   -> listener  who (the dialing stage; a ring link: stage | RING, replica) + nonce_d
    listener -> dialer    nonce_l + HMAC(key, "listener" | job | who | nonce_d | nonce_l)
    dialer   -> listener  HMAC(key, "dialer" | job | who | nonce_d | nonce_l)

So whoever holds a freed port learns nothing of the key and gets no activation (the dialer
checks the listener's proof before it sends anything else), and a dialer without the key is
dropped after two small frames. Every HELLO is at most ``HELLO_MAX`` bytes, checked in its
header before its payload is read. The listener gives each connection ``deadline`` for the
whole exchange, however slowly its bytes come.

Torch-free: the fellow's listener runs it before the engine is loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Collection

from swarm_core.pipeline.frames import (
    HEADER_SIZE,
    FrameError,
    FrameHeader,
    Kind,
    check_payload,
    make_header,
)

NONCE = 16
MAC = 32  # HMAC-SHA256
HELLO_MAX = 8 + NONCE + MAC  # the largest of the three payloads, with margin
RING = 1 << 31  # marks the ``who`` of a stage group's ring link
ROUTE = 1 << 30  # marks the ``who`` of a swarm-wired link to another replica's next stage


class HandshakeError(Exception):
    """The exchange failed; ``proof`` is True when the other end answered with a wrong proof
    (it does not hold the key), False when it went quiet, closed or sent no HELLO."""

    def __init__(self, message: str, proof: bool = False) -> None:
        super().__init__(message)
        self.proof = proof


def who(stage: int, replica: int | None = None, route: bool = False) -> bytes:
    """Who dials and what for: the dialing stage (the upstream neighbour of the stage it
    dials), or, with ``replica``, that replica of ``stage`` on its group's ring, or (with
    ``route``) that replica of ``stage`` dialling a replica of the next stage other than its
    own chain's (swarm wiring)."""
    if replica is None:
        return stage.to_bytes(4, "little")
    return (stage | (ROUTE if route else RING)).to_bytes(4, "little") + \
        replica.to_bytes(4, "little")


def _mac(key: str, role: bytes, job: int, caller: bytes, nonce_d: bytes, nonce_l: bytes
         ) -> bytes:
    msg = b"silentswarm-hello/6 " + role + b" " + str(job).encode() + b" " + caller + \
        nonce_d + nonce_l
    return hmac.new(key.encode(), msg, hashlib.sha256).digest()


def dial(sock: socket.socket, key: str, job: int, caller: bytes, deadline: float,
         abort: threading.Event | None = None) -> None:
    """The dialer's half; returns once the listener proved the key and has the dialer's
    proof. Waits for the listener until ``deadline`` (it may not be accepting yet)."""
    nonce_d = secrets.token_bytes(NONCE)
    _send(sock, job, caller + nonce_d)
    reply = _read(sock, job, deadline, abort)
    if len(reply) != NONCE + MAC:
        raise HandshakeError("the listener's answer is not a handshake reply", proof=True)
    nonce_l, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"listener", job, caller, nonce_d, nonce_l)):
        raise HandshakeError("the listener did not prove the job's session key", proof=True)
    _send(sock, job, _mac(key, b"dialer", job, caller, nonce_d, nonce_l))


def answer(sock: socket.socket, key: str, job: int, wanted: Collection[bytes],
           deadline: float) -> bytes:
    """The listener's half, all of it by ``deadline``: returns the dialer's ``who`` (one of
    ``wanted``) once it proved the key."""
    hello = _read(sock, job, deadline)
    caller, nonce_d = hello[:-NONCE], hello[-NONCE:]
    if len(hello) <= NONCE or caller not in wanted:
        raise HandshakeError("a hello from no peer this stage waits for")
    nonce_l = secrets.token_bytes(NONCE)
    _send(sock, job, nonce_l + _mac(key, b"listener", job, caller, nonce_d, nonce_l))
    proof = _read(sock, job, deadline)
    if not hmac.compare_digest(proof, _mac(key, b"dialer", job, caller, nonce_d, nonce_l)):
        raise HandshakeError("the dialer did not prove the job's session key", proof=True)
    return caller


def _send(sock: socket.socket, job: int, payload: bytes) -> None:
    header = make_header(Kind.HELLO, job, 0, 0, (len(payload),), 0, payload)
    try:
        sock.sendall(header.pack() + payload)
    except OSError as exc:
        raise HandshakeError(f"the link broke during the handshake: {exc}") from None


def _read(sock: socket.socket, job: int, deadline: float,
          abort: threading.Event | None = None) -> bytes:
    try:
        header = FrameHeader.unpack(bytes(_recv(sock, HEADER_SIZE, deadline, abort)),
                                    max_payload=HELLO_MAX)
        payload = bytes(_recv(sock, header.payload_len, deadline, abort))
        check_payload(header, payload)
    except FrameError as exc:
        raise HandshakeError(f"not a handshake frame: {exc}") from None
    if header.kind != Kind.HELLO or header.job != job:
        raise HandshakeError("not a hello of this job")
    return payload


def _recv(sock: socket.socket, n: int, deadline: float,
          abort: threading.Event | None = None) -> bytearray:
    """``n`` bytes by ``deadline`` in all (a peer trickling a byte at a time gains nothing),
    looking at ``abort`` every 0.2 s."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError("the handshake timed out")
        if abort is not None and abort.is_set():
            raise HandshakeError("stopped during the handshake")
        sock.settimeout(min(left, 0.2))
        try:
            r = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            continue
        except OSError as exc:
            raise HandshakeError(f"the link broke during the handshake: {exc}") from None
        if r == 0:
            raise HandshakeError("the other end closed during the handshake")
        got += r
    return buf
