#!/usr/bin/env python3
"""Churn: a 3-replica DiLoCo job whose fellows are killed and restarted while it trains (a
benchmark, not a test).

    python bench/churn.py                     # 10 minutes each way, a kill every 2 minutes
    python bench/churn.py --minutes 3 --every 40
    python bench/churn.py --quick             # 20 s each way, a kill every 8 s: a smoke run

Two runs of the same job on a local leader and three fellows, for the same wall time each:
without churn, and with one replica's fellow SIGKILLed every ``--every`` seconds (a replica
other than the first, in turn) and started again a few seconds later under the same name. The
survivors must lose no step: the lost replica leaves at the next outer step, the others go on
without a restart, and the restarted fellow joins back at a later one, taking a live
replica's state. Goodput is the replica-steps trained per second (each step's record says
which replicas trained it), churn against no churn; the issue's target is >= 90 %. Also
checked: every step of the churned run recorded once, no restart of the job, a departure and
a return recorded per kill. Talks only to 127.0.0.1; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from chaos import Cluster  # noqa: E402 (the same restartable local processes)

MODEL = {"name": "churn", "d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 32}
TARGET = 0.90


def job_body(steps: int, inner_steps: int) -> dict:
    return {"name": "churn", "kind": "train", "model": MODEL,
            "topology": {"stages": 1, "replicas": 3},
            "training": {"steps": steps, "batch_size": 12, "micro_batches": 1,
                         "eval_batches": 0, "frame_timeout_s": 10, "warmup_steps": 10,
                         "sync": {"mode": "diloco", "inner_steps": inner_steps}}}


def wait_running(c: Cluster, job_id: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.call("GET", f"/api/v1/jobs/{job_id}")
        if job["state"] == "RUNNING" and job["last_step"] > 0:  # type: ignore[index]
            return
        time.sleep(0.2)
    raise SystemExit(f"churn: {job_id} did not start stepping within {timeout:g}s")


def replica_steps(c: Cluster, job_id: str) -> tuple[int, list[int]]:
    """(replica-steps trained, the steps recorded)."""
    rows = c.call("GET", f"/api/v1/jobs/{job_id}/progress")["records"]  # type: ignore[index]
    trained = sum(len(r.get("replica_losses") or {}) for r in rows)
    return trained, [r["step"] for r in rows if r.get("loss") is not None]


def run(c: Cluster, seconds: float, every: float | None, inner_steps: int,
        down_s: float) -> dict:
    """One job for ``seconds`` of training (with a kill every ``every`` seconds); then it is
    cancelled and measured."""
    job_id = c.call("POST", "/api/v1/jobs", job_body(1_000_000, inner_steps))["job_id"]  # type: ignore[index]
    wait_running(c, job_id)
    t0 = time.monotonic()
    kills, turn = 0, 0
    events: list[tuple[float, float]] = []  # (kill, restart), wall clock (the records' ts)
    next_kill = t0 + every if every else None
    while (now := time.monotonic()) < t0 + seconds:
        if next_kill is not None and now >= next_kill:
            job = c.call("GET", f"/api/v1/jobs/{job_id}")
            replica = 1 + turn % 2
            turn += 1
            cell = next(s for s in job["placement"]["stages"]  # type: ignore[index]
                        if s["replica"] == replica)
            print(f"  t={now - t0:5.0f}s kill {cell['name']} (replica {replica}) at step "
                  f"{job['last_step']}", flush=True)  # type: ignore[index]
            killed_at = time.time()
            c.kill(cell["name"])
            time.sleep(down_s)
            c.start_fellow(cell["name"])
            events.append((killed_at, time.time()))
            kills += 1
            next_kill += every  # type: ignore[operator]
        time.sleep(0.2)
    wall = time.monotonic() - t0
    c.call("POST", f"/api/v1/jobs/{job_id}/cancel")
    job = c.call("GET", f"/api/v1/jobs/{job_id}")
    trained, steps = replica_steps(c, job_id)
    rows = c.call("GET", f"/api/v1/jobs/{job_id}/progress")["records"]  # type: ignore[index]
    return {"job": job, "wall": wall, "trained": trained, "steps": steps, "kills": kills,
            "phases": phases(rows, events)}


def phases(rows: list[dict], events: list[tuple[float, float]]) -> dict[str, float]:
    """Where a churned run's time goes, read off its step records (each stamped when the
    leader had every cell's report) and the kills: per kill, the seconds from the kill to the
    first step recorded without the replica (detecting the dead peer and regrouping) and from
    its restart to the step that records it joined (the process starting, registering, the
    leader's order, the next outer step and the state transfer); and the survivors' lost
    time, each step's excess over the median step, split by the window it fell in."""
    stamped = [(r["step"], r["ts"], r.get("membership") or []) for r in rows
               if r.get("ts") is not None]
    if len(stamped) < 3 or not events:
        return {}
    gaps = [(b[1] - a[1], a[1], b[1]) for a, b in itertools.pairwise(stamped)]
    median = statistics.median(g for g, _a, _b in gaps)
    left_at = [ts for _s, ts, ch in stamped if any(x.get("left") for x in ch)]
    joined_at = [ts for _s, ts, ch in stamped if any(x.get("joined") for x in ch)]
    detect, rejoin, windows = [], [], []
    for killed, restarted in events:
        left = next((ts for ts in left_at if ts >= killed), None)
        joined = next((ts for ts in joined_at if ts >= restarted), None)
        if left is not None:
            detect.append(left - killed)
            windows.append(("regroup", killed, left))
        if joined is not None:
            rejoin.append(joined - restarted)
            windows.append(("join", restarted, joined))
    lost = {"regroup": 0.0, "join": 0.0, "other": 0.0}
    for gap, start, end in gaps:
        excess = gap - median
        if excess <= 0:
            continue
        mid = (start + end) / 2
        where = next((name for name, a, b in windows if a <= mid <= b), "other")
        lost[where] += excess
    return {"median step s": median,
            "kill -> left s": statistics.mean(detect) if detect else float("nan"),
            "restart -> joined s": statistics.mean(rejoin) if rejoin else float("nan"),
            **{f"lost in {k} s": v for k, v in lost.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="of training, each run")
    ap.add_argument("--every", type=float, default=120.0, help="seconds between kills")
    ap.add_argument("--down", type=float, default=5.0, help="seconds a killed fellow stays down")
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="20 s each way, a kill every 8 s")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.every, args.down = 20 / 60, 8.0, 2.0
    if args.minutes <= 0 or args.every <= 0 or args.down < 0 or args.inner_steps < 1:
        print("churn: --minutes, --every and --inner-steps must be positive", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="swarm-churn-"))
    c = Cluster(tmp, 3, stale_s=2.0)
    try:
        c.start_leader()
        for name in c.names:
            c.start_fellow(name)
        seconds = args.minutes * 60
        print(f"no churn: {seconds:.0f} s", flush=True)
        calm = run(c, seconds, None, args.inner_steps, args.down)
        time.sleep(3)  # (the cancelled job's fellows free again)
        print(f"churn: {seconds:.0f} s, a kill every {args.every:g} s", flush=True)
        churned = run(c, seconds, args.every, args.inner_steps, args.down)
    finally:
        c.stop_all()
    rate = {k: r["trained"] / r["wall"] for k, r in (("calm", calm), ("churn", churned))}
    goodput = rate["churn"] / rate["calm"] if rate["calm"] else 0.0
    job = churned["job"]
    changes = job["membership"]
    left = sum(1 for ch in changes if ch["left"])
    joined = sum(1 for ch in changes if ch["joined"])
    steps = churned["steps"]
    print(f"\n{'run':<10}{'wall s':>8}{'steps':>8}{'replica-steps':>15}{'per s':>9}"
          f"{'kills':>7}{'left':>6}{'joined':>8}")
    for name, r in (("no churn", calm), ("churn", churned)):
        ch = r["job"]["membership"]
        print(f"{name:<10}{r['wall']:>8.0f}{len(r['steps']):>8}{r['trained']:>15}"
              f"{r['trained'] / r['wall']:>9.1f}{r['kills']:>7}"
              f"{sum(1 for x in ch if x['left']):>6}{sum(1 for x in ch if x['joined']):>8}")
    checks = {
        f"goodput {goodput:.1%} of no churn (target >= {TARGET:.0%})": goodput >= TARGET,
        "every step of the churned run recorded once":
            steps == list(range(1, len(steps) + 1)),
        "no restart of the job (the survivors never stopped)": job["restarts"] == [],
        f"a departure and a return per kill ({left} left, {joined} joined, "
        f"{churned['kills']} kills)": left >= churned["kills"] and joined >= churned["kills"] - 1,
    }
    print("\nwhere the churned run's time went (means per kill; survivors' lost seconds in all):")
    for what, value in churned["phases"].items():
        print(f"  {what:<24}{value:>8.2f}")
    for what, ok in checks.items():
        print(f"{'met' if ok else 'NOT met'}: {what}")
    print(f"(logs under {tmp})")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
