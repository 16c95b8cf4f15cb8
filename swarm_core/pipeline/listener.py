"""A fellow's data-plane listening socket, opened at daemon start (torch-free).

The address goes to the leader at registration and from there into every START's placement, so
the upstream neighbour can dial it. Only a connection whose first frame presents the job's
session key is accepted; anything else is dropped.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from swarm_core.pipeline.frames import (
    DATA_KINDS,
    DEFAULT_MAX_PAYLOAD,
    HEADER_SIZE,
    FrameError,
    FrameHeader,
    Kind,
    check_payload,
)
from swarm_core.pipeline.links import LinkShaper

if TYPE_CHECKING:
    from swarm_core.pipeline.transport import Liveness, PeerLink


class DataListener:
    """A fellow's data-plane listening socket (bound once, at daemon start)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.host = advertise or host  # what neighbours dial (``addr``); bound to ``host``
        self.port = self.sock.getsockname()[1]

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def accept(self, key: str, stage: int, job: int, shaper: LinkShaper,
               timeout: float, abort: threading.Event | None = None,
               max_payload: int = DEFAULT_MAX_PAYLOAD,
               receives: Collection[Kind] = DATA_KINDS,
               pulse_s: float | None = None, liveness: Liveness | None = None) -> PeerLink:
        """Accept the upstream neighbour; connections without the job's key are dropped."""
        from swarm_core.pipeline.transport import (
            LinkAborted,
            PeerLink,
            PeerTimeout,
            _hello_payload,
            _recv_exact,
            blaming,
        )

        deadline = time.monotonic() + timeout
        expected = _hello_payload(key, stage - 1)
        while True:
            if abort is not None and abort.is_set():
                raise LinkAborted("stopped while waiting for the upstream stage")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise blaming(PeerTimeout(f"stage {stage - 1} did not connect within "
                                          f"{timeout:g}s"), stage - 1)
            self.sock.settimeout(min(remaining, 0.2))
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            # (A connection that says nothing holds the accept at most until the deadline.)
            conn.settimeout(max(0.2, min(5.0, deadline - time.monotonic())))
            try:
                raw = _recv_exact(conn, HEADER_SIZE)
                header = FrameHeader.unpack(raw, max_payload=4096)
                payload = _recv_exact(conn, header.payload_len)
                check_payload(header, payload)
                if header.kind != Kind.HELLO or header.job != job or \
                        not hmac.compare_digest(bytes(payload), expected):
                    raise FrameError("bad hello (wrong job or session key)")
            except (OSError, FrameError):
                conn.close()
                continue
            conn.settimeout(None)
            return PeerLink(conn, shaper, job, f"stage {stage - 1} ({peer[0]}:{peer[1]})",
                            abort=abort, max_payload=max_payload, receives=receives,
                            pulse_s=pulse_s, liveness=liveness, peer_stage=stage - 1)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


