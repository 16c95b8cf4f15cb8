"""Kill the leader (SIGKILL) and restart it on the same state dir: nothing is lost."""

from __future__ import annotations

import signal

import pytest

from tests.clusters import cli_json, free_port, spawn, stop, wait_until

pytestmark = pytest.mark.slow


def test_killed_leader_restarts_with_queue_and_fellows(cli_env, tmp_path):
    state = tmp_path / "state"
    port = str(free_port())
    url = f"http://127.0.0.1:{port}"
    env = {**cli_env, "SWARM_TOKEN": "restart-test-token", "SWARM_LEADER_URL": url}
    logs = tmp_path / "logs"
    leader = spawn(["leader", "--state-dir", str(state), "--port", port], env, logs / "l1.log")
    fellows = [spawn(["fellow", "--leader-url", url, "--name", f"f{i}"], env,
                     logs / f"f{i}.log") for i in range(2)]
    try:
        def ready_names():
            try:
                fs = cli_json("fellows", env=env)["fellows"]
            except AssertionError:
                return None
            return sorted((f["fellow_id"], f["name"]) for f in fs if f["status"] == "ready")

        before = wait_until(lambda: (r := ready_names()) and len(r) == 2 and r, 20,
                            "two fellows ready")
        # Three fellows needed, two exist: both jobs stay queued.
        queued = [cli_json("submit", "--fellows", "3", "--name", f"q{i}", env=env)["job_id"]
                  for i in range(2)]
        assert stop(leader, signal.SIGKILL) == -signal.SIGKILL

        leader = spawn(["leader", "--state-dir", str(state), "--port", port], env,
                       logs / "l2.log")
        # The fellows notice the new leader and register again by themselves, same ids.
        after = wait_until(lambda: (r := ready_names()) == before and r, 30,
                           "fellows to re-register with the restarted leader")
        assert after == before
        jobs = cli_json("jobs", env=env)["jobs"]
        assert [(j["job_id"], j["name"], j["state"]) for j in jobs] == \
            [(queued[0], "q0", "PENDING"), (queued[1], "q1", "PENDING")]
        assert all(p.poll() is None for p in fellows), "fellows must survive a leader restart"
    finally:
        for p in fellows:
            stop(p)
        stop(leader)
    assert all(p.returncode == 0 for p in fellows), "fellows stop cleanly on SIGTERM"
