"""SIGTERM stops a fellow within seconds whatever it is doing: a fellow in the middle of a
stage whose leader has gone once took over 60 s (its step reports retried a leader that was not
there, and the stage's wind-down waited for them), where an idle one exits at once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from swarm_core.client import SwarmClient
from tests.clusters import free_port, pid_alive, spawn, stop, wait_until
from tests.support import REPO

pytestmark = pytest.mark.slow

# A stage that runs for minutes unless stopped: tiny, so the 2-core CI machine barely notices.
JOB = {"name": "long", "kind": "train",
       "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16},
       "training": {"steps": 1_000_000, "batch_size": 2, "micro_batches": 1,
                    "eval_batches": 0, "warmup_steps": 0},
       "topology": {"fellows": 1}}
STOPS_WITHIN_S = 5.0
TOKEN = "shutdown-test-token"


def _call(url: str, method: str, path: str, body: Any = None) -> Any:
    async def call() -> Any:
        async with SwarmClient(url, TOKEN) as client:
            return await client.request(method, f"/api/v1{path}", body)

    return asyncio.run(call())


def test_sigterm_stops_a_training_fellow_whose_leader_is_gone(cli_env, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**cli_env, "SWARM_TOKEN": TOKEN, "SWARM_LEADER_URL": url}
    logs = tmp_path / "logs"
    leader = spawn(["leader", "--state-dir", str(tmp_path / "state"), "--port", str(port)],
                   env, logs / "leader.log")
    fellow = spawn(["fellow", "--name", "f0"], env, logs / "fellow.log")
    try:
        wait_until(lambda: "leader listening" in (logs / "leader.log").read_text(), 30,
                   "the leader to listen")
        job = _call(url, "POST", "/jobs", JOB)["job_id"]
        wait_until(lambda: _call(url, "GET", f"/jobs/{job}")["last_step"] >= 2, 60,
                   "the stage to train a few steps")
        assert stop(leader, signal.SIGKILL) == -signal.SIGKILL
        # Until the fellow has seen the leader gone: its reports retry, its heartbeats back
        # off, and its stage trains on (a leader back from a restart takes it up again).
        wait_until(lambda: "heartbeat failed" in (logs / "fellow.log").read_text(), 10,
                   "the fellow to notice the leader is gone")
        time.sleep(1.0)
        assert fellow.poll() is None, "the fellow must outlive its leader"
        t0 = time.monotonic()
        fellow.send_signal(signal.SIGTERM)
        try:
            code = fellow.wait(STOPS_WITHIN_S)
        except Exception:
            code = None
        took = time.monotonic() - t0
        assert code == 0, (f"still running {took:.1f}s after SIGTERM (rc {code}); log tail: "
                           + (logs / "fellow.log").read_text()[-1500:])
        assert not pid_alive(fellow.pid)
        # (the stage thread itself stopped between its ops: not left behind by the timer)
        assert "a stage thread still ran" not in (logs / "fellow.log").read_text()
    finally:
        stop(fellow, signal.SIGKILL)
        stop(leader)


def test_a_stopped_fellow_leaves_a_stage_thread_stuck_in_one_op_behind():
    """What the daemon cannot end (a thread in a native call that checks no stop event) holds
    the process only EXIT_GRACE_S longer: the interpreter would wait for it for ever."""
    script = ("import asyncio, time\n"
              "from swarm_tui.commands.daemons import exit_within\n"
              "async def main():\n"
              "    asyncio.get_running_loop().run_in_executor(None, time.sleep, 120)\n"
              "    exit_within(0.5, 0)\n"
              "asyncio.run(main())\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0 and time.monotonic() - t0 < 20, proc.stderr
    assert "a stage thread still ran 0.5s after the fellow stopped" in proc.stderr
