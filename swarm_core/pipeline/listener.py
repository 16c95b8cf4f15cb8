"""A fellow's data-plane listening socket, opened at daemon start (torch-free).

The address goes to the leader at registration and from there into every START's placement, so
the upstream neighbour can dial it. Only a connection that proves the job's session key in the
handshake (``handshake``) is accepted; anything else is dropped.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import attrs

from swarm_core.pipeline import handshake
from swarm_core.pipeline.frames import DATA_KINDS, DEFAULT_MAX_PAYLOAD, Kind
from swarm_core.pipeline.links import Shaping

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
    shaper: Shaping
    max_payload: int = DEFAULT_MAX_PAYLOAD
    receives: Collection[Kind] = DATA_KINDS
    route: bool = False  # a swarm-wired upstream of another replica's chain

    @property
    def name(self) -> str:
        return f"stage {self.stage}" if self.replica is None else \
            f"stage {self.stage} replica {self.replica}"


HANDSHAKE_S = 3.0  # a connection's whole handshake, however slowly its bytes come
MAX_HANDSHAKES = 64  # at once; a connection beyond is closed (a real peer dials again)
ACCEPT_POLL_S = 0.1  # how soon an abort is seen
BACKLOG = 128


def _who(waiting: dict[bytes, Expected]) -> str:
    return " and ".join(e.name for e in waiting.values())


class DataListener:
    """A fellow's data-plane listening socket (bound once, at daemon start)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(BACKLOG)
        self.host = advertise or host  # what neighbours dial (``addr``); bound to ``host``
        self.port = self.sock.getsockname()[1]

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def accept(self, key: str, stage: int, job: int, shaper: Shaping,
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
                    liveness: Liveness | None = None,
                    cancel: threading.Event | None = None,
                    transport: str = "shaped") -> dict[str, PeerLink]:
        """Accept every peer in ``expected`` (the upstream stage, the previous replica on the
        stage group's ring), each told apart by its hello, once it proved the job's key (see
        ``handshake``). Handshakes run side by side, at most MAX_HANDSHAKES at once and each
        within HANDSHAKE_S, so connections that say nothing, or trickle, cannot hold the
        door; ``abort`` (the links' too) and ``cancel`` (this wait's only) are seen within
        ACCEPT_POLL_S. Returns the links by role."""
        from swarm_core.pipeline.transport import (
            LinkAborted,
            PeerTimeout,
            blaming,
            make_link,
        )

        deadline = time.monotonic() + timeout
        waiting = {handshake.who(e.stage, e.replica, e.route): e for e in expected}
        wanted = frozenset(waiting)
        links: dict[str, PeerLink] = {}
        done: queue.Queue[tuple[socket.socket, tuple, bytes | None]] = queue.Queue()
        lock = threading.Lock()
        state = {"open": 0, "ended": False}

        def serve(conn: socket.socket, peer: tuple) -> None:
            try:
                caller: bytes | None = handshake.answer(
                    conn, key, job, wanted, time.monotonic() + HANDSHAKE_S)
            except (OSError, handshake.HandshakeError):
                caller = None
            with lock:
                state["open"] -= 1
                if state["ended"] or caller is None:
                    conn.close()
                else:
                    done.put((conn, peer, caller))

        try:
            while waiting:
                while not done.empty():
                    conn, peer, caller = done.get()
                    e = waiting.pop(caller, None) if caller is not None else None
                    if e is None:  # (a second dialer as the same peer)
                        conn.close()
                        continue
                    conn.settimeout(None)
                    assert caller is not None
                    links[e.role] = make_link(
                        transport, conn, True, caller, deadline - time.monotonic(),
                        shaper=e.shaper, job=job, peer=f"{e.name} ({peer[0]}:{peer[1]})",
                        abort=abort, max_payload=e.max_payload, receives=e.receives,
                        pulse_s=pulse_s, liveness=liveness, peer_stage=e.stage)
                if not waiting:
                    break
                if any(e is not None and e.is_set() for e in (abort, cancel)):
                    raise LinkAborted(f"stopped while waiting for {_who(waiting)}")
                if time.monotonic() >= deadline:
                    first = next(iter(waiting.values()))
                    raise blaming(PeerTimeout(f"{_who(waiting)} did not connect within "
                                              f"{timeout:g}s"), first.stage)
                self.sock.settimeout(ACCEPT_POLL_S)
                try:
                    conn, peer = self.sock.accept()
                except TimeoutError:
                    continue
                with lock:
                    busy = state["open"] >= MAX_HANDSHAKES
                    if not busy:
                        state["open"] += 1
                if busy:  # (a real peer whose connection is dropped dials again)
                    conn.close()
                    continue
                threading.Thread(target=serve, args=(conn, peer), daemon=True,
                                 name="data-handshake").start()
        except BaseException:
            for link in links.values():
                link.close()
            raise
        finally:
            with lock:
                state["ended"] = True
            while not done.empty():
                done.get()[0].close()
        return links

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
