"""Helpers for tests that run real leader and fellow processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import REPO, swarm_argv


def run_cli(*args: str, env: dict[str, str], timeout: float = 60,
            check: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(swarm_argv(*args), capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"swarm {' '.join(args)} -> {proc.returncode}: {proc.stderr}")
    return proc


def cli_json(*args: str, env: dict[str, str]) -> Any:
    proc = run_cli(*args, "--format", "json", env=env, check=True)
    return json.loads(proc.stdout)


def leader_call(method: str, path: str, env: dict[str, str], body: Any = None) -> Any:
    """One call to the local cluster's leader (``path`` under /api/v1) through the project's
    client, in this process. For tests that poll or steer while a job runs and do not test the
    CLI: each ``swarm`` process costs a second of imports, several on a loaded machine, and a
    poll that slow lets the run it watches get ahead of the test."""
    from swarm_core.client import SwarmClient
    from swarm_core.leader import read_token

    record = json.loads((Path(env["SWARM_HOME"]) / "local-cluster" / "cluster.json").read_text())
    token = read_token(Path(record["state_dir"]))

    async def call() -> Any:
        async with SwarmClient(record["leader_url"], token) as client:
            return await client.request(method, f"/api/v1{path}", body)

    return asyncio.run(call())


def job_view(job_id: str, env: dict[str, str]) -> dict[str, Any]:
    """The job as ``swarm job --format json`` shows it (the leader's view), without a process."""
    return leader_call("GET", f"/jobs/{job_id}", env)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(swarm_argv(*args), stdout=fh, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)
