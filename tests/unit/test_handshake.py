"""The data plane's door: both ends prove the job's session key and neither sends it; silent
and trickling connections cannot keep the real neighbour out; a stop is seen at once.
Real sockets on loopback, a real listener and dialer."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from swarm_core.pipeline import handshake
from swarm_core.pipeline.frames import Kind, job_tag
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.listener import HANDSHAKE_S, DataListener
from swarm_core.pipeline.transport import LinkAborted, LinkClosed, PeerTimeout, connect

KEY = "the-jobs-session-key-0123456789"
TAG = job_tag("job-000001")


@pytest.fixture
def listener() -> Iterator[DataListener]:
    ln = DataListener()
    yield ln
    ln.close()


def _host_port(ln: DataListener) -> tuple[str, int]:
    host, port = ln.addr.rsplit(":", 1)
    return host, int(port)


def _accept_in_thread(ln: DataListener, timeout: float = 20, abort=None) -> tuple[
        threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["link"] = ln.accept(KEY, 1, TAG, LinkShaper(), timeout=timeout, abort=abort)
        except (PeerTimeout, LinkAborted) as exc:
            out["error"] = exc
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the listener closed ``s`` within its handshake time (and some slack)."""
    s.settimeout(HANDSHAKE_S + 5)
    try:
        while s.recv(64):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset: unread bytes were left, or it kept sending into the closed end
        pass
    return True


def _dial_in_and_step(ln: DataListener, accepting: threading.Thread, out: dict,
                      timeout: float) -> None:
    """The upstream stage with the job's key dials; once accepted, a frame goes each way."""
    dialer = connect(ln.addr, KEY, 0, TAG, LinkShaper(), timeout=timeout)
    accepting.join(timeout + 5)
    assert "link" in out, out
    accepted = out["link"]
    try:
        dialer.send_float(Kind.NORM, 1, 0, 2.5)
        assert accepted.recv_float(Kind.NORM, 1, 0, timeout=10) == 2.5
        accepted.send_float(Kind.NORM, 1, 1, 0.5)
        assert dialer.recv_float(Kind.NORM, 1, 1, timeout=10) == 0.5
    finally:
        dialer.close()
        accepted.close()


def test_only_a_dialer_with_the_key_gets_in_and_frames_flow(listener):
    t, out = _accept_in_thread(listener)
    # A dialer with another key: the listener's proof fails on its side, it goes away.
    with pytest.raises(LinkClosed, match="did not prove the job's session key"):
        connect(listener.addr, "another-key", 0, TAG, LinkShaper(), timeout=5)
    # Garbage instead of a hello: closed, nothing else happens.
    with socket.create_connection(_host_port(listener)) as s:
        s.sendall(b"not a frame at all" * 4)
        assert _closed_by_peer(s)
    _dial_in_and_step(listener, t, out, timeout=10)


def test_whoever_holds_the_port_learns_nothing_of_the_key():
    """A freed port taken by someone else: the dialer sends no key and no activation, and
    refuses the link when the answer proves nothing."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    seen = bytearray()

    def impostor() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            seen.extend(conn.recv(4096))
            handshake._send(conn, TAG, b"\0" * (handshake.NONCE + handshake.MAC))
            conn.settimeout(1)
            try:
                while chunk := conn.recv(4096):
                    seen.extend(chunk)
            except OSError:
                pass

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(LinkClosed, match="did not prove the job's session key"):
            connect(f"127.0.0.1:{port}", KEY, 0, TAG, LinkShaper(), timeout=5)
        t.join(5)
    finally:
        srv.close()
    assert seen and KEY.encode() not in bytes(seen)
    assert len(seen) < 200  # the hello and nothing after it


def test_silent_and_trickling_connections_do_not_keep_the_neighbour_out(listener):
    """64 connections that say nothing and 64 that trickle a byte every 0.3 s are open when
    the real upstream stage dials: it gets in, and a step's frames go through."""
    t, out = _accept_in_thread(listener, timeout=30)
    addr = _host_port(listener)
    silent = [socket.create_connection(addr) for _ in range(64)]
    tricklers = [socket.create_connection(addr) for _ in range(64)]
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            for s in tricklers:
                with contextlib.suppress(OSError):
                    s.send(b"S")
            stop.wait(0.3)

    drip = threading.Thread(target=trickle, daemon=True)
    drip.start()
    try:
        _dial_in_and_step(listener, t, out, timeout=25)
        # A trickler's whole handshake had HANDSHAKE_S: the listener closed it long since.
        assert all(_closed_by_peer(s) for s in (tricklers[0], tricklers[-1], silent[0]))
    finally:
        stop.set()
        drip.join(5)
        for s in silent + tricklers:
            s.close()


def test_a_stop_is_seen_at_once_even_with_a_handshake_hanging(listener):
    abort = threading.Event()
    t, out = _accept_in_thread(listener, timeout=30, abort=abort)
    hanging = [socket.create_connection(_host_port(listener)) for _ in range(8)]
    try:
        time.sleep(0.5)  # (the listener is serving their handshakes)
        set_at = time.monotonic()
        abort.set()
        t.join(10)
        seen_after = time.monotonic() - set_at
    finally:
        for s in hanging:
            s.close()
    assert isinstance(out.get("error"), LinkAborted), out
    assert seen_after < 1.0  # ACCEPT_POLL_S is 0.1; a loaded machine gets slack
