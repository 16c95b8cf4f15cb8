#!/usr/bin/env python3
"""Chaos: a queue of small jobs on a local leader and fellows while a driver SIGKILLs the leader
and the fellows at random moments, restarting each; at the end every job must be terminal.

    python bench/chaos.py                      # 12 jobs, 50 kills
    python bench/chaos.py --quick              # the short variant CI runs (smoke jobs, 3 kills)

The kills land wherever the run is: between a dispatch and its STARTs, mid-step, inside a
recovery (train jobs recover under resume_policy replace), mid-upload of a shard. Invariants
checked at the end: every job terminal and the queue drained (no job wedged), each COMPLETED
train job's progress holds every step once (no record lost or doubled), and its export is
complete. Runs its processes under a temporary SWARM_HOME and talks only to 127.0.0.1. Prints
a table of what happened and exits non-zero when an invariant fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = {"name": "chaos", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A leader and named fellows as processes of their own, each restartable."""

    def __init__(self, tmp: Path, fellows: int, stale_s: float) -> None:
        self.tmp, self.stale_s = tmp, stale_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = tmp / "state"
        self.env = {**os.environ, "SWARM_HOME": str(tmp / "home"), "SWARM_LEADER_URL": self.url}
        self.env.pop("SWARM_TOKEN", None)
        self.names = [f"chaos-{i}" for i in range(fellows)]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.token = ""
        self.starts = 0

    def _spawn(self, who: str, *args: str) -> None:
        self.starts += 1
        log = open(self.tmp / f"{who}-{self.starts}.log", "wb")  # noqa: SIM115 (the child's)
        self.procs[who] = subprocess.Popen(
            [sys.executable, "-m", "swarm_tui.cli", *args], env=self.env, cwd=REPO,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_leader(self) -> None:
        self._spawn("leader", "leader", "--state-dir", str(self.state), "--port",
                    str(self.port), "--stale-after", f"{self.stale_s:g}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            token = self.state / "token"
            if token.exists() and not self.token:
                self.token = token.read_text().strip()
                self.env["SWARM_TOKEN"] = self.token
            try:
                if self.token and self.call("GET", "/api/v1/info"):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit("chaos: the leader did not come up (see its log)")

    def start_fellow(self, name: str) -> None:
        self._spawn(name, "fellow", "--name", name, "--data-root", str(REPO))

    def kill(self, who: str) -> None:
        proc = self.procs.get(who)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()

    def call(self, method: str, path: str, body: object = None) -> object:
        req = urllib.request.Request(
            self.url + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}",
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as res:
            return json.loads(res.read())

    def jobs(self) -> list[dict]:
        return self.call("GET", "/api/v1/jobs")["jobs"]  # type: ignore[index]


def job_body(i: int, rng: random.Random, smoke_only: bool) -> dict:
    """The i-th job: two smoke jobs, then a train job (which recovers), and again."""
    if smoke_only or i % 3:
        return {"name": f"chaos-smoke-{i}", "kind": "smoke", "topology": {"fellows": 2},
                "training": {"steps": rng.randint(20, 60), "step_seconds": 0.05}}
    return {"name": f"chaos-train-{i}", "kind": "train", "model": MODEL,
            "topology": {"fellows": 2},
            "training": {"steps": 40, "batch_size": 4, "micro_batches": 2, "eval_batches": 1,
                         "shard_push_interval_steps": 5, "resume_policy": "replace",
                         "max_restarts": 1000, "frame_timeout_s": 10, "seed": i}}


def where(c: Cluster) -> str:
    """What the running job was doing when a kill landed."""
    try:
        running = [j for j in c.jobs() if j["state"] == "RUNNING"]
    except (OSError, urllib.error.URLError):
        return "leader down"
    if not running:
        return "between jobs"
    j = running[0]
    what = "recovering" if j["reason"].startswith("recovering") else \
        "starting" if j["last_step"] == 0 else f"at step {j['last_step']}"
    return f"{j['job_id']} ({j['kind']}) {what}"


def check(c: Cluster) -> tuple[list[str], list[str]]:
    """(wedged jobs, lost or doubled records / incomplete exports)."""
    jobs = c.jobs()
    wedged = [f"{j['job_id']} {j['state']}: {j['reason'] or j['waiting_for']}"
              for j in jobs if j["state"] not in TERMINAL]
    bad = []
    for j in jobs:
        if j["kind"] != "train" or j["state"] != "COMPLETED":
            continue
        rows = c.call("GET", f"/api/v1/jobs/{j['job_id']}/progress")["records"]  # type: ignore
        steps = [r["step"] for r in rows]
        want = list(range(1, j["training"]["steps"] + 1))
        if steps != want:
            bad.append(f"{j['job_id']}: {len(steps)} step records, "
                       f"{len(set(steps))} distinct, of {len(want)}")
        manifest = c.state / "runs" / j["job_id"] / "model_export" / "run_manifest.json"
        if not manifest.exists() or not json.loads(manifest.read_text()).get("complete"):
            bad.append(f"{j['job_id']}: export incomplete")
    return wedged, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=12, help="queued at the start (more follow "
                    "whenever the queue runs dry before the last kill)")
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--fellows", type=int, default=3, help="(one more than a job needs)")
    ap.add_argument("--stale-after", type=float, default=2.0)
    ap.add_argument("--gap", type=float, default=3.0, help="mean seconds between kills")
    ap.add_argument("--drain-s", type=float, default=300.0, help="how long the queue may take "
                    "to drain after the last kill")
    ap.add_argument("--smoke-only", action="store_true", help="no train jobs (no torch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="3 smoke jobs, 3 kills a second or two apart")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.kills, args.smoke_only, args.gap, args.drain_s = 3, 3, True, 1.5, 60.0
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="swarm-chaos-"))
    c = Cluster(tmp, args.fellows, args.stale_after)
    events: list[tuple[float, str, str]] = []
    t0 = time.monotonic()
    try:
        c.start_leader()
        for name in c.names:
            c.start_fellow(name)
        for i in range(args.jobs):
            c.call("POST", "/api/v1/jobs", job_body(i, rng, args.smoke_only))
        submitted = args.jobs
        for _ in range(args.kills):
            time.sleep(rng.uniform(0.2, 2 * args.gap))
            if all(j["state"] in TERMINAL for j in c.jobs()):
                # Kills between jobs test little: the queue is kept busy until the last one.
                c.call("POST", "/api/v1/jobs", job_body(submitted, rng, args.smoke_only))
                submitted += 1
                time.sleep(rng.uniform(0.0, 1.0))
            victim = "leader" if rng.random() < 0.5 else rng.choice(c.names)
            events.append((time.monotonic() - t0, f"kill {victim}", where(c)))
            c.kill(victim)
            time.sleep(rng.uniform(0.1, 1.5))
            if victim == "leader":
                c.start_leader()
            else:
                c.start_fellow(victim)
        deadline = time.monotonic() + args.drain_s
        while time.monotonic() < deadline and check(c)[0]:
            time.sleep(1)
        wedged, bad = check(c)
        jobs = c.jobs()
    finally:
        c.stop_all()
    print(f"{'t (s)':>7}  {'kill':<16} while")
    for t, what, during in events:
        print(f"{t:7.1f}  {what:<16} {during}")
    states = {s: sum(j["state"] == s for j in jobs) for s in TERMINAL}
    print(f"\n{'kills survived':<24}{len(events)}"
          f" ({sum('leader' in e[1] for e in events)} of the leader)")
    print(f"{'jobs':<24}{len(jobs)}: " + ", ".join(f"{n} {s.lower()}" for s, n in states.items()))
    print(f"{'wedged jobs':<24}{len(wedged)}")
    print(f"{'lost/doubled records':<24}{len(bad)}")
    for line in wedged + bad:
        print("  " + line)
    for j in jobs:
        if j["state"] == "FAILED":
            print(f"  failed {j['job_id']}: {j['reason'][:120]}")
    ok = not wedged and not bad
    print("chaos:", "PASSED" if ok else "FAILED", f"(logs in {tmp})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
