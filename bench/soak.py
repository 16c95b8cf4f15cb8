#!/usr/bin/env python3
"""Soak: a small 3-fellow job runs for N minutes while one of its fellows is SIGKILLed and
restarted every K seconds; at the end the job must have COMPLETED with whole artifacts.

    python bench/soak.py                 # 10 minutes, a kill every 2 minutes
    python bench/soak.py --minutes 2 --kill-every 40

Not part of the test suite (it takes minutes). Runs its own local cluster under a temporary
SWARM_HOME and talks only to 127.0.0.1. Prints a table of what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = {"name": "soak", "d_model": 64, "n_layers": 3, "n_heads": 4, "seq_len": 32}


def swarm(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "swarm_tui.cli", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)
    if check and proc.returncode != 0:
        raise SystemExit(f"swarm {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def job(job_id: str, env: dict[str, str]) -> dict:
    return json.loads(swarm("job", job_id, "--format", "json", env=env).stdout)


def submit(env: dict[str, str], steps: int, tmp: Path) -> str:
    body = {"name": "soak", "kind": "train", "model": MODEL,
            "training": {"steps": steps, "batch_size": 8, "micro_batches": 4,
                         "eval_batches": 2, "shard_push_interval_steps": 10,
                         "resume_policy": "replace", "max_restarts": 1000,
                         "frame_timeout_s": 20},
            "topology": {"fellows": 3}}
    path = tmp / f"soak-{steps}.json"
    path.write_text(json.dumps(body))
    return json.loads(swarm("submit", "--payload", str(path), "--format", "json",
                            env=env).stdout)["job_id"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", type=float, default=120.0, help="seconds between kills")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="swarm-soak-"))
    env = {**os.environ, "SWARM_HOME": str(tmp / "home")}
    env.pop("SWARM_LEADER_URL", None)
    swarm("restart-cluster", "--fellows", "3", "--stale-after", "3", env=env)
    record = json.loads((tmp / "home" / "local-cluster" / "cluster.json").read_text())
    env["SWARM_TOKEN"] = (Path(record["state_dir"]) / "token").read_text().strip()
    restarted: list[subprocess.Popen] = []
    events = []
    try:
        # Calibrate: steps per second of this job on this machine, then size the soak.
        cal = submit(env, 30, tmp)
        while (c := job(cal, env))["state"] not in ("COMPLETED", "FAILED"):
            time.sleep(0.5)
        # Steady-state rate from the last stage's tokens/s (startup excluded).
        rate = c["metrics"]["tokens_per_s"] / (8 * MODEL["seq_len"])
        steps = max(50, int(rate * args.minutes * 60 * 0.8))  # recoveries cost time too
        job_id = submit(env, steps, tmp)
        print(f"soak: {steps} steps at ~{rate:.1f} steps/s, a kill every {args.kill_every:g}s")
        start = time.monotonic()
        next_kill = start + args.kill_every
        while True:
            info = job(job_id, env)
            if info["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            if time.monotonic() >= next_kill and info["state"] == "RUNNING" and info["fellows"]:
                fid = rng.choice(info["fellows"])
                name = next(s["name"] for s in info["placement"]["stages"]
                            if s["fellow_id"] == fid)
                fellows = json.loads(swarm("fellows", "--format", "json", env=env).stdout)
                pid = next(f["pid"] for f in fellows["fellows"] if f["fellow_id"] == fid)
                os.kill(pid, signal.SIGKILL)
                events.append((time.monotonic() - start, info["last_step"], f"killed {name}"))
                time.sleep(1)
                with open(tmp / f"{name}-{len(events)}.log", "wb") as log:
                    restarted.append(subprocess.Popen(
                        [sys.executable, "-m", "swarm_tui.cli", "fellow", "--leader-url",
                         record["leader_url"], "--name", name], env=env, cwd=REPO,
                        stdout=log, stderr=subprocess.STDOUT))
                events.append((time.monotonic() - start, info["last_step"],
                               f"restarted {name}"))
                next_kill += args.kill_every
            time.sleep(1)
        info = job(job_id, env)
        wall = time.monotonic() - start
    finally:
        for p in restarted:
            p.send_signal(signal.SIGTERM)
        swarm("stop-cluster", env=env, check=False)
    export = Path(record["state_dir"]) / "runs" / job_id / "model_export"
    steps_seen = [s for s, _ in info["loss_history"]]
    whole = steps_seen == list(range(1, steps + 1))
    manifest = json.loads((export / "run_manifest.json").read_text()) \
        if (export / "run_manifest.json").exists() else {}
    print(f"{'t (s)':>8}  {'step':>6}  event")
    for t, step, what in events:
        print(f"{t:8.1f}  {step:6d}  {what}")
    print(f"\njob {job_id}: {info['state']} after {wall:.0f}s, {len(info['restarts'])} restart(s)")
    print(f"loss curve: {len(steps_seen)} steps recorded, whole: {whole}")
    print(f"shards: complete={manifest.get('complete')} at step {manifest.get('step')}")
    ok = info["state"] == "COMPLETED" and whole and manifest.get("complete") is True
    print("soak:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
