"""A local cluster: one leader and N fellows as background processes, recorded by pid.

The record (``<SWARM_HOME>/local-cluster/cluster.json``) is how ``stop-cluster`` and the next
``restart-cluster`` find the processes again; a pid is only signalled while its command line
still names this program, so a recycled pid is never killed. Used by the CLI, the console
(``swarm-tui --local``) and scripts alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs

from swarm_core import jsonio
from swarm_core.client import ClientError, SwarmClient, wait_for_leader
from swarm_core.paths import (
    atomic_write,
    default_state_dir,
    dir_problem,
    local_cluster_dir,
    private_dir_problem,
    swarm_home,
)
from swarm_core.protocol import FellowStatus
from swarm_core.schema import SchemaError, structure, unstructure

RECORD_FILE = "cluster.json"
FELLOW_PREFIX = "local-"


class ClusterError(Exception):
    """The local cluster cannot be read, started or reached. ``usage``: what was asked for
    cannot be (a port in use, a path that cannot be a directory); ``unreachable``: its leader
    did not come up."""

    def __init__(self, message: str, *, usage: bool = False, unreachable: bool = False) -> None:
        super().__init__(message)
        self.usage, self.unreachable = usage, unreachable


@attrs.define
class ProcessEntry:
    pid: int
    name: str
    log: str
    # The command line after ``python -m swarm_tui.cli``, so a churn replay can start a fellow
    # it killed again as it was (empty in a record from before).
    argv: list[str] = attrs.field(factory=list)


@attrs.define
class ClusterRecord:
    leader_url: str
    state_dir: str
    leader: ProcessEntry
    fellows: list[ProcessEntry]
    started_at: float


def record_path() -> Path:
    return local_cluster_dir() / RECORD_FILE


def read_record() -> ClusterRecord | None:
    """The local cluster's record; None when there is none. A record that cannot be read is an
    error, not "no cluster": stop-cluster would otherwise say there is nothing to stop while
    the processes it names run on."""
    path = record_path()
    try:
        return structure(jsonio.loads(path.read_bytes()), ClusterRecord, strict=False)
    except (FileNotFoundError, NotADirectoryError):  # (no record where none could be)
        return None
    except (OSError, ValueError, SchemaError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ClusterError(f"{path}: unreadable local cluster record ({why}); stop the "
                           "swarm processes it started by hand, then remove it") from None


def record_of(leader_url: str) -> ClusterRecord | None:
    """The local cluster's record when ``leader_url`` is its leader; None otherwise (a remote
    leader's fellows may share its fellows' names), or where the record cannot be read."""
    try:
        record = read_record()
    except ClusterError:
        return None
    if record is None or record.leader_url.rstrip("/") != leader_url.rstrip("/"):
        return None
    return record


def token_for(record: ClusterRecord) -> str | None:
    from swarm_core.leader import TokenFileError, read_token  # (aiohttp's server: on demand)

    try:
        return os.environ.get("SWARM_TOKEN") or read_token(Path(record.state_dir))
    except TokenFileError as exc:
        raise ClusterError(str(exc)) from None


def _ours(pid: int) -> bool:
    """Alive, and still one of our processes (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True  # no /proc (macOS): trust the record
    return b"swarm_tui.cli" in cmdline or b"swarm" in cmdline.split(b"\0")[0]


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def stop_processes(pids: list[int], timeout_s: float = 8.0) -> list[int]:
    """SIGTERM, wait, then SIGKILL what is left. Returns the pids that were signalled."""
    targets = [p for p in pids if process_alive(p) and _ours(p)]
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(process_alive(p) for p in targets):
        time.sleep(0.05)
    for pid in targets:
        if process_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return targets


def stop_cluster() -> ClusterRecord | None:
    record = read_record()
    if record is None:
        return None
    # Fellows first, so they say goodbye to a leader that is still there.
    stop_processes([f.pid for f in record.fellows])
    stop_processes([record.leader.pid])
    with contextlib.suppress(FileNotFoundError):
        record_path().unlink()
    return record


def _recorded_argv(entry: ProcessEntry) -> list[str]:
    """The fellow's command line after ``-m swarm_tui.cli``: as recorded, else as /proc shows
    it while it runs (a record from before argv was kept); empty when neither can say."""
    if entry.argv:
        return list(entry.argv)
    try:
        parts = Path(f"/proc/{entry.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    args = [p.decode(errors="replace") for p in parts if p]
    return args[args.index("swarm_tui.cli") + 1:] if "swarm_tui.cli" in args else []


def kill_fellow(name: str) -> int | None:
    """SIGKILL the local cluster's fellow ``name`` (a crash, not a goodbye) and wait until it
    is gone; its pid, None when it was not running. Its command line is kept in the record
    first, so :func:`start_fellow` can start it again."""
    record = read_record()
    entry = next((f for f in record.fellows if f.name == name), None) if record else None
    if record is None or entry is None:
        raise ClusterError(f"the local cluster has no fellow named {name!r}")
    if not (process_alive(entry.pid) and _ours(entry.pid)):
        return None
    if not entry.argv:
        entry.argv = _recorded_argv(entry)
        _write(record)
    with contextlib.suppress(ProcessLookupError):
        os.kill(entry.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while process_alive(entry.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return entry.pid


def start_fellow(name: str) -> ProcessEntry:
    """Start the local cluster's fellow ``name`` as it was started (a name the record lacks:
    a new fellow, started as its first one is but for its name), unless it runs; the record
    then names the new process, so stop-cluster stops it."""
    record = read_record()
    if record is None:
        raise ClusterError("no local cluster: 'swarm restart-cluster' starts one")
    entry = next((f for f in record.fellows if f.name == name), None)
    if entry is not None and process_alive(entry.pid) and _ours(entry.pid):
        return entry
    model = entry or (record.fellows[0] if record.fellows else None)
    argv = _recorded_argv(model) if model is not None else []
    if "--name" not in argv[:-1]:
        raise ClusterError(f"cannot start fellow {name!r}: the local cluster's record does "
                           "not say how its fellows were started (restart the cluster)")
    argv[argv.index("--name") + 1] = name
    token = token_for(record)
    env = {k: v for k, v in os.environ.items() if k != "SWARM_LEADER_URL"}
    if token:
        env["SWARM_TOKEN"] = token
    log = Path(entry.log) if entry is not None else \
        local_cluster_dir() / "logs" / f"fellow-{name}.log"
    proc = _spawn(argv, log, env)
    new = ProcessEntry(proc.pid, name, str(log), argv)
    at = record.fellows.index(entry) if entry is not None else len(record.fellows)
    record.fellows[at:at + 1] = [new]
    _write(record)
    return new


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _spawn(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "swarm_tui.cli", *argv],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # survives the CLI's exit and its terminal's Ctrl-C
        )


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


@attrs.define
class ClusterSpec:
    fellows: int
    port: int | None = None
    state_dir: Path | None = None
    stale_after_s: float = 5.0
    devices: str = "cpu"
    threads: int = 1
    timeout_s: float = 30.0
    # Where the fellows' jobs may read files (--data-root): by default the directory the
    # cluster was started from, where a researcher's corpus and configs are.
    data_roots: tuple[str, ...] | None = None


def check_spec(spec: ClusterSpec) -> None:
    """What would make the new cluster fail to start, found before the running one is
    stopped: a refused restart leaves the cluster that was there."""
    for path, what, check in ((swarm_home(), "SWARM_HOME", dir_problem),
                              (spec.state_dir or default_state_dir(), "--state-dir",
                               private_dir_problem)):
        problem = check(path)
        if problem:
            raise ClusterError(f"{what}: {problem}", usage=True)
    running = read_record()
    if spec.port and not (running and running.leader_url.endswith(f":{spec.port}")):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", spec.port))
            except OSError as exc:
                raise ClusterError(f"--port {spec.port}: {exc.strerror}", usage=True) \
                    from None
    slots = [d.strip() for d in spec.devices.split(",") if d.strip()]
    if any(d != "cpu" for d in slots):  # (torch, seconds to import, only for a GPU slot)
        from swarm_core.pipeline.devices import DeviceError, check_slots

        try:
            check_slots(slots)
        except DeviceError as exc:
            raise ClusterError(f"--devices: {exc}", usage=True) from None


def start_cluster(spec: ClusterSpec) -> ClusterRecord:
    """Stop the previous local cluster, start a leader and N fellows, wait until all are ready.
    Nothing is stopped when the new one is bound to fail (:func:`check_spec`)."""
    check_spec(spec)
    stop_cluster()
    home = local_cluster_dir()
    logs = home / "logs"
    state_dir = (spec.state_dir or default_state_dir()).resolve()
    port = spec.port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.pop("SWARM_LEADER_URL", None)
    leader = _spawn(["leader", "--state-dir", str(state_dir), "--port", str(port),
                     "--stale-after", str(spec.stale_after_s)], logs / "leader.log", env)
    record = ClusterRecord(
        leader_url=url, state_dir=str(state_dir),
        leader=ProcessEntry(leader.pid, "leader", str(logs / "leader.log")),
        fellows=[], started_at=time.time(),
    )
    _write(record)
    try:
        asyncio.run(_wait_leader(url, leader, logs / "leader.log", spec.timeout_s))
        token = token_for(record)
        if token is None:
            raise ClusterError(f"leader started but wrote no token in {state_dir}")
        fenv = {**env, "SWARM_TOKEN": token}  # the environment, not argv: ps shows argv
        for i in range(spec.fellows):
            name = f"{FELLOW_PREFIX}{i}"
            log_path = logs / f"fellow-{i}.log"
            roots = spec.data_roots if spec.data_roots is not None else (os.getcwd(),)
            argv = ["fellow", "--leader-url", url, "--name", name,
                    "--devices", spec.devices, "--threads", str(spec.threads),
                    *(arg for root in roots for arg in ("--data-root", root))]
            proc = _spawn(argv, log_path, fenv)
            record.fellows.append(ProcessEntry(proc.pid, name, str(log_path), argv))
        _write(record)
        asyncio.run(_wait_fellows(url, token, record, spec.timeout_s))
    except BaseException:
        stop_cluster()
        raise
    return record


def _write(record: ClusterRecord) -> None:
    atomic_write(record_path(), jsonio.dumps(unstructure(record), pretty=True), mode=0o600)


async def _wait_leader(url: str, proc: subprocess.Popen[bytes], log: Path,
                       timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ClusterError(f"leader exited with code {proc.returncode}: {_tail(log)}")
        try:
            await wait_for_leader(url, 0.5)
            return
        except ClientError:
            if time.monotonic() > deadline:
                raise ClusterError(f"leader at {url} not up after {timeout_s:g}s: "
                                   f"{_tail(log)}", unreachable=True) from None


async def _wait_fellows(url: str, token: str, record: ClusterRecord, timeout_s: float) -> None:
    names = {f.name for f in record.fellows}
    deadline = time.monotonic() + timeout_s
    async with SwarmClient(url, token) as client:
        while True:
            fellows = await client.fellows()
            ready = {f.name for f in fellows
                     if f.name in names and f.status is FellowStatus.READY}
            if ready == names:
                return
            for entry in record.fellows:
                if not process_alive(entry.pid):
                    raise ClusterError(f"fellow {entry.name} exited: {_tail(Path(entry.log))}")
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(names - ready))
                raise ClusterError(f"fellows not ready after {timeout_s:g}s: {missing}")
            await asyncio.sleep(0.1)
