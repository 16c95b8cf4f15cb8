"""Starting and stopping fellows on the hosts of a hostfile, over the system ``ssh``.

Each host gets one ssh session, all at once: ``ssh -T -o BatchMode=yes HOST -- exec PYTHON
-m swarm_core.launch.remote``, with the request (leader URL, token, the fellows to start) on
its standard input. A host that cannot be reached, or whose far end fails, is reported with
ssh's or the far end's own last word; the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from pathlib import Path
from typing import Any

import attrs

from swarm_core import jsonio
from swarm_core.launch.hostfile import HostEntry

CONNECT_TIMEOUT_S = 10
HOST_TIMEOUT_S = 60.0  # one host's whole session (the far end waits STOP_WAIT_S at most)
REMOTE_MODULE = "swarm_core.launch.remote"


@attrs.define
class HostResult:
    host: str
    ok: bool
    error: str = ""
    fellows: list[dict[str, Any]] = attrs.field(factory=list)


def ssh_argv(entry: HostEntry, ssh_config: Path | None = None) -> list[str]:
    """The command that reaches ``entry``: nothing secret in it (``ps`` shows it)."""
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
    if ssh_config is not None:
        argv += ["-F", str(ssh_config)]
    # The remote command is one string for the remote shell: quoted, so a python path with
    # odd characters stays one word (the hostfile allows none, but quoting costs nothing).
    return [*argv, entry.host, "--", f"exec {shlex.quote(entry.python)} -m {REMOTE_MODULE}"]


def start_request(entry: HostEntry, leader_url: str, token: str | None,
                  data_host: str | None = None) -> dict[str, Any]:
    """What the far end needs (the URL and token among it: this goes on ssh's stdin). The
    host's own data_host wins over the launch's."""
    args: list[str] = []
    if entry.data_host or data_host:
        args += ["--data-host", entry.data_host or data_host or ""]
    if entry.data_advertise:
        args += ["--data-advertise", entry.data_advertise]
    return {"action": "start", "leader_url": leader_url, "token": token,
            "fellows": [{"name": f.name, "devices": list(f.devices), "args": args}
                        for f in entry.fellows()]}


def stop_request(entry: HostEntry) -> dict[str, Any]:
    return {"action": "stop", "names": [f.name for f in entry.fellows()]}


async def run_host(entry: HostEntry, request: dict[str, Any],
                   ssh_config: Path | None = None,
                   timeout_s: float = HOST_TIMEOUT_S) -> HostResult:
    argv = ssh_argv(entry, ssh_config)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        return HostResult(entry.host, False, f"cannot run ssh: {exc.strerror}")
    try:
        out, err = await asyncio.wait_for(proc.communicate(jsonio.dumps(request)), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return HostResult(entry.host, False, f"no answer within {timeout_s:g} s")
    said = _last_line(err)
    reply = _reply(out)
    if proc.returncode == 255 and reply is None:  # ssh's own failure: it did not get there
        return HostResult(entry.host, False, f"cannot reach it over ssh: {said or 'ssh failed'}")
    if reply is None:
        why = said or f"exit status {proc.returncode}"
        if proc.returncode == 127:
            why = f"{entry.python} not found there ({why})"
        elif "No module named" in said:
            why = f"{entry.python} there has no SilentSwarm ({said})"
        return HostResult(entry.host, False, why)
    if "error" in reply:
        return HostResult(entry.host, False, str(reply["error"]))
    fellows = [f for f in reply.get("fellows", []) if isinstance(f, dict)]
    failed = [f for f in fellows if not f.get("ok")]
    if failed:
        return HostResult(entry.host, False, "; ".join(
            f"fellow {f.get('name')}: {f.get('error', 'failed')}" for f in failed), fellows)
    return HostResult(entry.host, True, "", fellows)


async def run_all(entries: list[HostEntry], requests: list[dict[str, Any]],
                  ssh_config: Path | None = None) -> list[HostResult]:
    return list(await asyncio.gather(*(run_host(e, r, ssh_config)
                                       for e, r in zip(entries, requests, strict=True))))


def _last_line(raw: bytes) -> str:
    lines = [x.strip() for x in raw.decode(errors="replace").splitlines() if x.strip()]
    return lines[-1][:300] if lines else ""


def _reply(raw: bytes) -> dict[str, Any] | None:
    for line in reversed(raw.splitlines()):
        with contextlib.suppress(ValueError):
            obj = jsonio.loads(line)
            if isinstance(obj, dict):
                return obj
    return None
