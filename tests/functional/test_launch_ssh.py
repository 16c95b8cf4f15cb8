"""``swarm launch --hostfile`` for real: an ``sshd`` on 127.0.0.1 (a free port, a throwaway
host key and user key), two fellows launched through it train a 2-stage job, a third host
that cannot be reached is one line and the exit code, ``--stop`` stops them. Without sshd the
test fails rather than skips: the launcher is only tested here."""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarm_core.client import SwarmClient
from tests.clusters import free_port, pid_alive, run_cli, spawn, stop, wait_until
from tests.support import REPO

pytestmark = pytest.mark.slow

TINY = {"name": "tiny", "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 16}


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "swarm-test", "-f",
                    str(path)], check=True, capture_output=True, timeout=30)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """An sshd for this test only, and an ssh config whose hosts h1 and h2 reach it and whose
    host dead reaches a closed port."""
    binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.access(binary, os.X_OK):
        pytest.fail("sshd is not installed (apt-get install openssh-server; .ci/run does)")
    d = tmp_path / "ssh"
    d.mkdir(mode=0o700)
    _keygen(d / "host_key")
    _keygen(d / "user_key")
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    remote_home = tmp_path / "remote-home"  # the hosts' SWARM_HOME: launch records, logs
    port = free_port()
    (d / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {d / 'host_key'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile {d / 'authorized_keys'}
# (the test's files live under /tmp, which sshd's ownership checks refuse)
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
SetEnv SWARM_HOME={remote_home} PYTHONPATH={REPO}
""")
    Path("/run/sshd").mkdir(exist_ok=True)  # (its privilege separation directory)
    log = open(d / "sshd.log", "wb")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.05)
        host_pub = (d / "host_key.pub").read_text().split()[:2]
        (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {' '.join(host_pub)}\n")
        closed = free_port()
        (d / "config").write_text(f"""\
Host dead
  Port {closed}
Host h1 h2 dead
  HostName 127.0.0.1
  Port {port}
  User {getpass.getuser()}
  IdentityFile {d / 'user_key'}
  IdentitiesOnly yes
  UserKnownHostsFile {d / 'known_hosts'}
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  LogLevel ERROR
""")
        yield {"config": d / "config", "remote_home": remote_home, "log": d / "sshd.log"}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _call(url: str, token: str, method: str, path: str, body: Any = None) -> Any:
    async def call() -> Any:
        async with SwarmClient(url, token) as client:
            return await client.request(method, f"/api/v1{path}", body)

    return asyncio.run(call())


def test_launch_over_ssh_trains_a_job_and_stops_the_fellows(sshd, cli_env, tmp_path):
    from swarm_core.leader import read_token

    python = sys.executable
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"""\
# two machines of one fellow each, and one that is down
h1 slots=1 devices=cpu python={python}
h2 python={python}
dead slots=1 python={python}
""")
    state = tmp_path / "state"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    leader = spawn(["leader", "--state-dir", str(state), "--port", str(port)], cli_env,
                   tmp_path / "leader.log")
    try:
        token = wait_until(lambda: read_token(state), 30, "the leader's token")
        wait_until(lambda: _listening(port), 30, "the leader")
        flags = ["--leader-url", url, "--token", token, "launch", "--hostfile", str(hostfile),
                 "--ssh-config", str(sshd["config"])]
        dry = run_cli(*flags, "--dry-run", env=cli_env)
        assert dry.returncode == 0, dry.stderr
        assert token not in dry.stdout and url not in dry.stdout
        assert "ssh -T -o BatchMode=yes" in dry.stdout and "h1: start h1 (cpu)" in dry.stdout

        up = run_cli(*flags, "--format", "json", env=cli_env, timeout=120)
        # One host failed: the exit code says so, and one line names it.
        assert up.returncode == 1, up.stderr
        assert [line for line in up.stderr.splitlines() if line.strip()] == [
            next(line for line in up.stderr.splitlines() if "host dead" in line)]
        assert "cannot reach it over ssh" in up.stderr
        hosts = {h["host"]: h for h in json.loads(up.stdout)["hosts"]}
        assert hosts["h1"]["ok"] and hosts["h2"]["ok"] and not hosts["dead"]["ok"]
        pids = [f["pid"] for h in ("h1", "h2") for f in hosts[h]["fellows"]]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        # The token reached the fellows through their environment, not their command lines.
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert token.encode() not in b" ".join(argv) and b"--name" in argv
            assert f"SWARM_TOKEN={token}".encode() in \
                Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")

        def ready() -> list[str]:
            fellows = _call(url, token, "GET", "/fellows")["fellows"]
            names = sorted(f["name"] for f in fellows if f["status"] == "ready")
            return names if names == ["h1", "h2"] else []

        wait_until(ready, 90, "both launched fellows to be ready")
        # Through the test's sshd, as its user key (and in its session's environment).
        assert sshd["log"].read_text().count("Accepted publickey") >= 2
        assert (sshd["remote_home"] / "launch" / "h1.log").exists()
        job = _call(url, token, "POST", "/jobs", {
            "name": "over-ssh", "kind": "train", "model": TINY, "topology": {"fellows": 2},
            "training": {"steps": 3, "batch_size": 4, "micro_batches": 2,
                         "eval_batches": 1}})

        def finished() -> dict[str, Any] | None:
            j = _call(url, token, "GET", f"/jobs/{job['job_id']}")
            return j if j["state"] in ("COMPLETED", "FAILED", "CANCELLED") else None

        done = wait_until(finished, 120, "the 2-stage job", interval=0.5)
        assert done["state"] == "COMPLETED", done["reason"]
        assert sorted(s["name"] for s in done["placement"]["stages"]) == ["h1", "h2"]
        assert [s for s, _ in done["loss_history"]] == [1, 2, 3]

        down = run_cli(*flags, "--stop", "--format", "json", env=cli_env, timeout=120)
        assert down.returncode == 1 and "host dead" in down.stderr
        stopped = {h["host"]: h for h in json.loads(down.stdout)["hosts"]}
        assert all(f["stopped"] for h in ("h1", "h2") for f in stopped[h]["fellows"])
        wait_until(lambda: not any(pid_alive(p) for p in pids), 20, "the fellows to exit")
        assert not list((sshd["remote_home"] / "launch").glob("*.json"))
    finally:
        stop(leader)
        for pid in locals().get("pids", []):
            if pid_alive(pid):
                os.kill(pid, 9)
