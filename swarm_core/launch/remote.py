"""The far end of ``swarm launch``: run by ssh on each host as
``PYTHON -m swarm_core.launch.remote``, it reads one JSON request on its standard input and
answers one JSON line on its standard output.

The request carries the leader URL and token; they reach each fellow through its environment
(``SWARM_LEADER_URL``, ``SWARM_TOKEN``), never a command line, since ``ps`` shows command
lines to every user of the machine. Fellows are started detached (their own session, output
to a log file) so the ssh session ends while they run on; each is recorded in
``$SWARM_HOME/launch/<name>.json`` (atomically), which is how ``stop`` finds it again. A pid is
only signalled while its command line is still that fellow's.

Imports nothing heavy: it starts on every host of a launch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from swarm_core import jsonio
from swarm_core.paths import atomic_write, ensure_private_dir, swarm_home

MAX_REQUEST = 1 << 20
START_GRACE_S = 1.0  # a fellow that exits this soon (bad flag, bad devices) is a failure
STOP_WAIT_S = 15.0  # then SIGKILL


def launch_dir() -> Path:
    return swarm_home() / "launch"


def _record(name: str) -> Path:
    return launch_dir() / f"{name}.json"


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") \
            .split("\0")[:-1]
    except OSError:
        return []


def _is_fellow(pid: int, name: str) -> bool:
    """Whether pid is still the fellow of that name (not a recycled pid, not a zombie)."""
    argv = _cmdline(pid)
    if "fellow" not in argv or "--name" not in argv:
        return False
    i = argv.index("--name")
    if i + 1 >= len(argv) or argv[i + 1] != name:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _running(name: str) -> int | None:
    try:
        rec = jsonio.loads(_record(name).read_bytes())
        pid = int(rec["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if _is_fellow(pid, name) else None


def _last_line(log: Path) -> str:
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def start(req: dict[str, Any]) -> list[dict[str, Any]]:
    url, token = str(req["leader_url"]), req.get("token")
    env = {k: v for k, v in os.environ.items() if k not in ("SWARM_LEADER_URL", "SWARM_TOKEN")}
    env["SWARM_LEADER_URL"] = url
    if token:
        env["SWARM_TOKEN"] = str(token)
    env["PYTHONUNBUFFERED"] = "1"
    ensure_private_dir(launch_dir())
    out: list[dict[str, Any]] = []
    started: list[tuple[dict[str, Any], subprocess.Popen[bytes], Path]] = []
    for f in req["fellows"]:
        name = str(f["name"])
        pid = _running(name)
        if pid is not None:
            out.append({"name": name, "ok": True, "pid": pid, "already": True,
                        "log": str(launch_dir() / f"{name}.log")})
            continue
        argv = [sys.executable, "-m", "swarm_tui.cli", "fellow", "--name", name,
                "--devices", ",".join(f["devices"]), *[str(a) for a in f.get("args", [])]]
        log = launch_dir() / f"{name}.log"
        try:
            with open(log, "ab") as fh:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, cwd=Path.home())
        except OSError as exc:
            out.append({"name": name, "ok": False, "error": f"cannot start: {exc.strerror}"})
            continue
        atomic_write(_record(name), jsonio.dumps({"pid": proc.pid, "name": name,
                                                  "argv": argv, "started_at": time.time(),
                                                  "log": str(log)}), mode=0o600)
        started.append((f, proc, log))
    deadline = time.monotonic() + START_GRACE_S
    for f, proc, log in started:
        try:
            code = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out.append({"name": f["name"], "ok": True, "pid": proc.pid, "log": str(log)})
            continue
        with contextlib.suppress(OSError):
            _record(str(f["name"])).unlink()
        out.append({"name": f["name"], "ok": False, "log": str(log),
                    "error": f"exited at once ({code}): {_last_line(log) or 'no output'}"})
    return out


def stop(req: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    waiting: list[tuple[str, int]] = []
    for raw in req["names"]:
        name = str(raw)
        pid = _running(name)
        if pid is None:
            with contextlib.suppress(OSError):
                _record(name).unlink()
            out.append({"name": name, "ok": True, "stopped": False})
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        waiting.append((name, pid))
    deadline = time.monotonic() + STOP_WAIT_S
    for name, pid in waiting:
        while _is_fellow(pid, name) and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = _is_fellow(pid, name)
        if killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            _record(name).unlink()
        out.append({"name": name, "ok": True, "stopped": True, "pid": pid, "killed": killed})
    return out


def main() -> int:
    raw = sys.stdin.buffer.read(MAX_REQUEST + 1)
    try:
        if len(raw) > MAX_REQUEST:
            raise ValueError("request too large")
        req = jsonio.loads(raw)
        action = req["action"]
        fellows = start(req) if action == "start" else stop(req) if action == "stop" else None
        if fellows is None:
            raise ValueError(f"unknown action {action!r}")
    except (ValueError, KeyError, TypeError) as exc:
        sys.stdout.write(jsonio.dumps({"error": f"bad request: {exc}"}).decode() + "\n")
        return 2
    except OSError as exc:
        sys.stdout.write(jsonio.dumps({"error": f"{exc.filename or ''}: {exc.strerror}"})
                         .decode() + "\n")
        return 1
    sys.stdout.write(jsonio.dumps({"fellows": fellows,
                                   "host": os.uname().nodename}).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
