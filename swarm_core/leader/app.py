"""The leader's app factory and runner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
from aiohttp import WSCloseCode, web

from swarm_core.leader import content_coding
from swarm_core.leader.auth import auth_middleware, load_or_create_token
from swarm_core.leader.errors import error_middleware
from swarm_core.leader.events import EventHub
from swarm_core.leader.keys import CONFIG_KEY, STATE_KEY, WEBSOCKETS_KEY
from swarm_core.leader.queue import JobQueue
from swarm_core.leader.registry import FellowRegistry
from swarm_core.leader.routes import add_routes
from swarm_core.leader.state import LeaderState
from swarm_core.leader.store import Store, StoreError, StoreWriteError
from swarm_core.paths import ensure_private_dir

log = logging.getLogger("swarm.leader")

DB_FILE = "leader.sqlite3"


@attrs.define
class LeaderConfig:
    state_dir: Path
    token: str | None = None  # None: SWARM_TOKEN, else the state dir's token file
    stale_after_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    max_json_bytes: int = 1 << 20
    max_upload_bytes: int = 4 << 30  # shard pushes: streamed to disk, limit checked as they come
    tick_s: float = 0.25
    flush_s: float = 2.0  # status and identity changes
    telemetry_flush_s: float = 30.0  # counters and steps of otherwise unchanged fellows


async def _state_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG_KEY]
    store = Store(cfg.state_dir / DB_FILE)
    registry = FellowRegistry(cfg.stale_after_s, cfg.heartbeat_interval_s)
    registry.load(store.load_fellows())
    registry.id_floor = store.next_fellow_id()
    hub = EventHub()
    jobs = JobQueue(store, registry, hub, runs_dir=cfg.state_dir / "runs")
    app[STATE_KEY] = LeaderState(cfg.state_dir, store, registry, jobs, hub)
    yield
    app[STATE_KEY].flush(telemetry=True)
    store.close()


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG_KEY]
    st = app[STATE_KEY]

    def flush(telemetry: bool = False) -> None:
        try:
            st.flush(telemetry)
        except StoreWriteError as exc:  # (the records stay dirty for the next flush)
            st.jobs.not_stored("fellow records", exc)

    async def tick() -> None:
        last_status: dict[int, str] = {}
        last_flush = last_telemetry = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(cfg.tick_s)
            try:
                for rec in st.registry.all():
                    status = st.registry.status(rec)
                    if last_status.get(rec.fellow_id, status) != status:
                        st.fellow_event("fellow.status", rec)
                    last_status[rec.fellow_id] = status
                st.jobs.check_liveness()
                st.jobs.dispatch()
                now = loop.time()
                if now - last_telemetry >= cfg.telemetry_flush_s:
                    last_flush = last_telemetry = now
                    flush(telemetry=True)
                elif now - last_flush >= cfg.flush_s:
                    last_flush = now
                    flush()
            except Exception:
                log.exception("leader tick failed")

    task = asyncio.create_task(tick(), name="leader-tick")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _release_clients(app: web.Application) -> None:
    # Before the server waits for running handlers: long polls and event streams end now.
    app[STATE_KEY].registry.release_polls()
    app[STATE_KEY].hub.close_all()
    for ws in [*app[WEBSOCKETS_KEY]]:  # a copy: each handler drops its socket as it closes
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"leader shutting down")


def create_app(config: LeaderConfig) -> web.Application:
    ensure_private_dir(config.state_dir)
    token = load_or_create_token(config.state_dir, config.token or os.environ.get("SWARM_TOKEN"))
    app = web.Application(
        middlewares=[error_middleware, auth_middleware(token)],
        client_max_size=config.max_json_bytes,
        handler_args=content_coding.HANDLER_ARGS,  # bodies decoded by the API, not the parser
    )
    app[CONFIG_KEY] = config
    app[WEBSOCKETS_KEY] = weakref.WeakSet()
    app.cleanup_ctx.append(_state_ctx)
    app.cleanup_ctx.append(_background_ctx)
    app.on_shutdown.append(_release_clients)
    add_routes(app)
    return app


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (``localhost``: 127.0.0.1 and ::1, as
    aiohttp binds them); with port 0 all share the port the first one got."""
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            if socks and port == 0:
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (its IPv4 twin, if any, has its own socket)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(128)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


LOCK_FILE = "leader.lock"


class StateDirBusy(StoreError):
    """Another leader serves this state directory."""


def lock_state_dir(state_dir: Path) -> int:
    """Hold ``leader.lock`` in the state directory, with this pid in it; returns its fd (the
    kernel lets go when the fd closes or the process exits, however it exits). Two leaders on
    one directory would each write the fellow table and the job queue from their own memory."""
    import fcntl

    ensure_private_dir(state_dir)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateDirBusy(f"{state_dir}: another leader (pid {holder}) serves this state "
                           "directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def run_leader(config: LeaderConfig, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve until SIGINT/SIGTERM. Prints the URL once listening (scripts wait for it).

    The port is bound before anything else: a port in use fails with nothing created (no
    state, no token) and nothing announced, and port 0 announces the port it got."""
    socks = _listen(host, port)
    bound = socks[0].getsockname()[1]
    url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
    lock = None
    try:
        lock = lock_state_dir(config.state_dir)  # held while this leader serves
        app = create_app(config)
    except OSError as exc:  # (named here: the caller reads an OSError as the port's)
        for sock in socks:
            sock.close()
        if lock is not None:
            os.close(lock)
        raise StoreError(f"{config.state_dir}: cannot set up the leader's state: "
                         f"{exc.strerror or exc}") from None
    except BaseException:
        for sock in socks:
            sock.close()
        if lock is not None:
            os.close(lock)
        raise

    async def announce(_app: web.Application) -> None:
        print(f"leader listening on {url} (state {config.state_dir})", flush=True)

    app.on_startup.append(announce)
    try:
        web.run_app(app, sock=socks, print=None, access_log=None,
                    handle_signals=True, shutdown_timeout=3.0)
    finally:
        os.close(lock)
