"""The headless console end to end: real leader and fellow processes, the CLI as subprocesses."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from tests.clusters import cli_json, job_view, leader_call, pid_alive, run_cli, wait_until

pytestmark = pytest.mark.slow


def _record(swarm_home: Path) -> dict:
    return json.loads((swarm_home / "local-cluster" / "cluster.json").read_text())


def test_restart_cluster_then_steer_it(cli_env, swarm_home):
    started = run_cli("restart-cluster", "--fellows", "2", env=cli_env, timeout=90)
    assert started.returncode == 0, started.stderr
    url = started.stdout.strip()
    assert url.startswith("http://127.0.0.1:")
    record = _record(swarm_home)
    try:
        fellows = cli_json("fellows", env=cli_env)["fellows"]
        assert [f["status"] for f in fellows] == ["ready", "ready"]
        assert sorted(f["name"] for f in fellows) == ["local-0", "local-1"]

        target = fellows[1]["fellow_id"]
        res = run_cli("set-speed", "--fellow-id", str(target), "--tx-mbps", "80",
                      "--rx-mbps", "40", "--latency-ms", "5", env=cli_env)
        assert res.returncode == 0, res.stderr

        def link_reported():
            f = cli_json("fellows", env=cli_env)["fellows"][target]
            return f["link"] == {"tx_mbps": 80.0, "rx_mbps": 40.0, "latency_ms": 5.0} and f

        # Delivered by long-poll, reported by the fellow's next heartbeat (within ~1 s).
        wait_until(link_reported, 3.0, "the fellow to report its new link limits")
        untouched = cli_json("fellows", env=cli_env)["fellows"][1 - target]
        assert untouched["link"]["tx_mbps"] is None

        # The fellow process's own log, through the leader (the read asks the fellow, which
        # posts its tail with its next heartbeat; the command waits for it).
        shipped = cli_json("fellow-log", str(target), "--lines", "50", env=cli_env)
        assert shipped["name"] == fellows[1]["name"] and shipped["age_s"] < 5, shipped
        assert any("SET_SPEED" in ln for ln in shipped["lines"]), shipped["lines"]
        shown = run_cli("fellow-log", fellows[1]["name"], "--lines", "1", env=cli_env)
        assert shown.returncode == 0, shown.stderr
        head, *tail = shown.stdout.splitlines()
        assert head.startswith(f"fellow {target} ({fellows[1]['name']}): the last 1 line(s)")
        assert len(tail) == 1

        nodes = cli_json("nodes", env=cli_env)["nodes"]
        assert all(n["control_tx"] > 0 and n["control_rx"] > 0 for n in nodes)

        released = cli_json("release", "--all", env=cli_env)["released"]
        assert sorted(released) == [0, 1]
        wait_until(lambda: all(f["status"] == "released"
                               for f in leader_call("GET", "/fellows", cli_env)["fellows"]),
                   5.0, "both fellows to report released")
        # Released fellows leave: their daemons exit.
        wait_until(lambda: not any(pid_alive(f["pid"]) for f in record["fellows"]), 10.0,
                   "the released fellow processes to exit")
    finally:
        stopped = run_cli("stop-cluster", env=cli_env)
    assert stopped.returncode == 0, stopped.stderr
    assert not pid_alive(record["leader"]["pid"])
    assert not (swarm_home / "local-cluster" / "cluster.json").exists()


def test_restart_cluster_replaces_the_previous_one(cli_env, swarm_home):
    first = run_cli("restart-cluster", "--fellows", "1", env=cli_env, timeout=90)
    assert first.returncode == 0, first.stderr
    old = _record(swarm_home)
    try:
        second = run_cli("restart-cluster", "--fellows", "1", env=cli_env, timeout=90)
        assert second.returncode == 0, second.stderr
        new = _record(swarm_home)
        assert not pid_alive(old["leader"]["pid"])
        assert not pid_alive(old["fellows"][0]["pid"])
        assert pid_alive(new["leader"]["pid"])
        # Same state dir, same fellow name: the fellow keeps its id across the restart.
        fellows = cli_json("fellows", env=cli_env)["fellows"]
        assert [(f["fellow_id"], f["name"], f["status"]) for f in fellows] == \
            [(0, "local-0", "ready")]
        # A restart bound to fail is refused before anything is stopped: the running cluster
        # stays, and says so in one line, exit 2.
        a_file = swarm_home / "not-a-dir"
        a_file.write_text("x")
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            for argv, message in ((["--devices", "bogus"], "'bogus' is not 'cpu' or 'cuda:N'"),
                                  (["--state-dir", str(a_file)], "is not a directory"),
                                  (["--port", str(taken)], f"--port {taken}: "),
                                  (["--fellows", "1000"], "<= 64, got 1000")):
                refused = run_cli("restart-cluster", *argv, env=cli_env, timeout=90)
                assert refused.returncode == 2, (argv, refused.stderr)
                assert message in refused.stderr and refused.stderr.count("\n") == 1, \
                    refused.stderr
        assert _record(swarm_home) == new and pid_alive(new["leader"]["pid"])
        assert [f["status"] for f in cli_json("fellows", env=cli_env)["fellows"]] == ["ready"]
    finally:
        run_cli("stop-cluster", env=cli_env)


def test_smoke_job_runs_and_watch_exits_zero(cli_env):
    assert run_cli("restart-cluster", "--fellows", "2", env=cli_env, timeout=90).returncode == 0
    try:
        res = run_cli("submit", "--fellows", "2", "--steps", "3", "--watch", env=cli_env,
                      timeout=60)
        assert res.returncode == 0, res.stderr
        assert "COMPLETED at step 3" in res.stdout
        jobs = cli_json("jobs", env=cli_env)["jobs"]
        assert [(j["state"], j["last_step"], sorted(j["fellows"])) for j in jobs] == \
            [("COMPLETED", 3, [0, 1])]

        # A job that asks for more fellows than exist waits, and says why; cancel ends it.
        queued = cli_json("submit", "--fellows", "3", env=cli_env)
        assert queued["state"] == "PENDING"
        assert "needs 3 ready fellow(s), 2 ready" in queued["waiting_for"]
        cancelled = cli_json("cancel", queued["job_id"], env=cli_env)
        assert cancelled["state"] == "CANCELLED"
        # A page at a time: the first job, and where the next page starts.
        page = cli_json("jobs", "--limit", "1", env=cli_env)
        assert [j["job_id"] for j in page["jobs"]] == [jobs[0]["job_id"]]
        assert page["next_after"] == jobs[0]["job_id"]
        rest = run_cli("jobs", "--after", page["next_after"], env=cli_env)
        assert queued["job_id"] in rest.stdout and jobs[0]["job_id"] not in rest.stdout
        assert "more:" not in rest.stdout
        # The latest to finish first (the cancelled one finished after the completed one).
        latest = cli_json("jobs", "--order", "finished", "--limit", "1",
                          "--state", "completed,cancelled", env=cli_env)
        assert [j["job_id"] for j in latest["jobs"]] == [queued["job_id"]]
        assert (latest["next_after"], latest["total"]) == (queued["job_id"], 2)
        more = run_cli("jobs", "--order", "finished", "--limit", "1", env=cli_env)
        assert f"more: swarm jobs --order finished --after {queued['job_id']}" in more.stdout
        watched = run_cli("watch", queued["job_id"], env=cli_env)
        assert watched.returncode == 1
        assert "CANCELLED" in watched.stdout
        # Why it did not complete is one line on stderr, in json mode too (stdout: events).
        for fmt in ("table", "json"):
            watched = run_cli("watch", queued["job_id"], "--format", fmt, env=cli_env)
            assert watched.returncode == 1
            assert watched.stderr.splitlines() == [
                f"{queued['job_id']} CANCELLED at step 0: cancelled by request"]

        # A set-speed mid-run is recorded in the running job, and `swarm job` shows it.
        # (long enough that a loaded machine cannot finish it first; cancelled once checked)
        long = cli_json("submit", "--fellows", "2", "--steps", "400", env=cli_env)
        wait_until(lambda: job_view(long["job_id"], cli_env)["last_step"] >= 1,
                   15.0, "the job to take a step")
        res = run_cli("set-speed", "--fellow-id", "1", "--tx-mbps", "8", env=cli_env)
        assert res.returncode == 0, res.stderr
        assert f"recorded in running job {long['job_id']}" in res.stdout
        shown = run_cli("job", long["job_id"], env=cli_env)
        line = next(ln for ln in shown.stdout.splitlines() if ln.startswith("link set @"))
        assert "fellow 1: tx 8 Mbit/s, rx unlimited" in line, shown.stdout
        # By cell of the running job: a stage (every replica), a replica (every stage).
        cells = {(c["stage"], c["replica"]): c["fellow_id"]
                 for c in job_view(long["job_id"], cli_env)["placement"]["stages"]}
        by_stage = cli_json("set-speed", "--stage", "1", "--tx-mbps", "9", env=cli_env)
        assert by_stage["job_id"] == long["job_id"]
        assert [f["fellow_id"] for f in by_stage["fellows"]] == [cells[(1, 0)]]
        by_replica = cli_json("set-speed", "--replica", "0", "--latency-ms", "1", env=cli_env)
        assert sorted(f["fellow_id"] for f in by_replica["fellows"]) == sorted(cells.values())
        beyond = run_cli("set-speed", "--stage", "2", "--tx-mbps", "9", env=cli_env)
        assert beyond.returncode == 2
        assert f"--stage 2: the running job {long['job_id']} has 2 stage(s), 0-1" in \
            beyond.stderr
        cli_json("cancel", long["job_id"], env=cli_env)

        # A job reads only files under the fellows' data roots (the local cluster's: the
        # directory it was started from), not the token in a fellow's own environment.
        nosy = leader_call("POST", "/jobs", cli_env, {
            "kind": "train", "topology": {"fellows": 2},
            "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
            "training": {"steps": 2, "batch_size": 2, "micro_batches": 1, "dataset": "textfiles",
                         "dataset_paths": ["/proc/self/environ"]}})
        failed = wait_until(lambda: (j := job_view(nosy["job_id"], cli_env))["state"]
                            in ("FAILED", "COMPLETED") and j, 60, "the job to end")
        assert failed["state"] == "FAILED"
        assert "'/proc/self/environ' is outside this fellow's data roots" in failed["reason"]
    finally:
        run_cli("stop-cluster", env=cli_env)


def test_swarm_tui_cmd_is_the_same_cli(cli_env):
    exe = Path(sys.executable).parent / "swarm-tui"
    assert exe.exists(), "swarm-tui entry point is not installed"
    import subprocess

    a = subprocess.run([str(exe), "--cmd", "info", "--format", "json"], capture_output=True,
                       text=True, env=cli_env, timeout=30)
    b = run_cli("info", "--format", "json", env=cli_env)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja.keys() == jb.keys() and ja["version"] == jb["version"]


def test_a_leader_binds_before_it_creates_anything(cli_env, tmp_path):
    """A port in use fails in one line with no state or token left behind, and nothing said
    to be listening; port 0 announces the port it got."""
    import subprocess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_cli("leader", "--port", str(port), "--state-dir", str(tmp_path / "s"),
                      env=cli_env)
    assert res.returncode == 1
    assert res.stdout == "" and len(res.stderr.splitlines()) == 1
    assert f"cannot serve on 127.0.0.1:{port}" in res.stderr
    assert not (tmp_path / "s").exists()

    proc = subprocess.Popen([sys.executable, "-m", "swarm_tui.cli", "leader", "--port", "0",
                             "--state-dir", str(tmp_path / "z")], env=cli_env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        got = int(line.split()[3].rsplit(":", 1)[1])
        assert got != 0, line
        with socket.create_connection(("127.0.0.1", got), timeout=5):
            pass  # listening where it said
        # A second leader on the same state directory would write the same fellow table and
        # queue from its own memory: it is refused in one line naming the first, which serves on.
        second = run_cli("leader", "--port", "0", "--state-dir", str(tmp_path / "z"),
                         env=cli_env)
        assert second.returncode == 2, second.stderr
        assert second.stderr.splitlines() == [
            f"swarm: {tmp_path / 'z'}: another leader (pid {proc.pid}) serves this state "
            "directory"], second.stderr
        assert proc.poll() is None
        with socket.create_connection(("127.0.0.1", got), timeout=5):
            pass
    finally:
        proc.terminate()
        proc.wait(timeout=10)
