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
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import attrs

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


@attrs.frozen
class Expected:
    """A peer a stage waits to be dialled by: its role ("up", "ring"), the stage it is, and
    for a ring peer its replica; the link it gets is shaped by ``shaper`` and carries
    ``receives`` in frames of at most ``max_payload`` bytes."""

    role: str
    stage: int
    replica: int | None
    shaper: LinkShaper
    max_payload: int = DEFAULT_MAX_PAYLOAD
    receives: Collection[Kind] = DATA_KINDS

    @property
    def name(self) -> str:
        return f"stage {self.stage}" if self.replica is None else \
            f"stage {self.stage} replica {self.replica}"


def _who(waiting: dict[bytes, Expected]) -> str:
    return " and ".join(e.name for e in waiting.values())


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
        return self.accept_many(key, job, [Expected("up", stage - 1, None, shaper, max_payload,
                                                    receives)],
                                timeout, abort, pulse_s, liveness)["up"]

    def accept_many(self, key: str, job: int, expected: Sequence[Expected], timeout: float,
                    abort: threading.Event | None = None, pulse_s: float | None = None,
                    liveness: Liveness | None = None) -> dict[str, PeerLink]:
        """Accept every peer in ``expected`` (the upstream stage, the previous replica on the
        stage group's ring), each told apart by what its hello says; connections without the
        job's key, or that nobody expects, are dropped. Returns the links by role."""
        from swarm_core.pipeline.transport import (
            LinkAborted,
            PeerLink,
            PeerTimeout,
            _hello_payload,
            _recv_exact,
            blaming,
        )

        deadline = time.monotonic() + timeout
        waiting = {_hello_payload(key, e.stage, e.replica): e for e in expected}
        links: dict[str, PeerLink] = {}
        try:
            while waiting:
                if abort is not None and abort.is_set():
                    raise LinkAborted(f"stopped while waiting for {_who(waiting)}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    first = next(iter(waiting.values()))
                    raise blaming(PeerTimeout(f"{_who(waiting)} did not connect within "
                                              f"{timeout:g}s"), first.stage)
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
                    e = next((e for h, e in waiting.items()
                              if hmac.compare_digest(bytes(payload), h)), None)
                    if header.kind != Kind.HELLO or header.job != job or e is None:
                        raise FrameError("bad hello (wrong job or session key)")
                except (OSError, FrameError):
                    conn.close()
                    continue
                conn.settimeout(None)
                del waiting[_hello_payload(key, e.stage, e.replica)]
                links[e.role] = PeerLink(
                    conn, e.shaper, job, f"{e.name} ({peer[0]}:{peer[1]})", abort=abort,
                    max_payload=e.max_payload, receives=e.receives, pulse_s=pulse_s,
                    liveness=liveness, peer_stage=e.stage)
        except BaseException:
            for link in links.values():
                link.close()
            raise
        return links

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


