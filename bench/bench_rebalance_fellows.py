#!/usr/bin/env python3
"""SWARM's rebalancing across fellow processes (issue 34 point 3; a benchmark, not a test).

The same experiment as ``bench_hetero.py``'s rebalancing table, run the way a cluster runs
it: a local leader and six fellow processes (``local_cluster``), one cell each, S=2 x R=3,
swarm wiring with measured routes, dp. Two of stage 1's peers are slowed 4x (the fellows'
own emulated slowdown, ``set-speed --slowdown``: their compute padded with sleeps) and every
fellow is padded ``--pad`` x its compute, so that six processes on two cores still compute
a small part of their time (the padding frees the core). One job with
``topology.rebalance_every`` (SWARM's rule every that many steps, decided in band by the
cells; the leader learns each move from their reports), one without, side by side.

Step times are the leader's own: the time between consecutive steps' records (``ts``, when
the last of a step's reports came in). Phases between moves leave out the move's step and
the two after it (the re-link and the state hand-off; before measured routes kept their
estimate across a move, an equal deal), printed on their own. Target (issue 34):
throughput after rebalancing >= 1.3x before.

    .venv/bin/python bench/bench_rebalance_fellows.py           # 24 steps a job (~2 min)
    .venv/bin/python bench/bench_rebalance_fellows.py --quick   # a tiny model, 8 steps

Only 127.0.0.1: the cluster is a local one under a temporary SWARM_HOME.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

STAGES, REPLICAS, SLOW = 2, 3, 4.0
SLOWED = ((1, 1), (1, 2))  # (stage, id) of the slowed peers
FULL = dict(model=dict(d_model=128, n_layers=4, n_heads=4, seq_len=64), batch=48, micro=8,
            steps=24, every=8)
QUICK = dict(model=dict(d_model=32, n_layers=2, n_heads=2, seq_len=16), batch=12, micro=2,
             steps=8, every=3)


async def run_job(c: Any, cfg: dict[str, Any], pad: float, every: int | None
                  ) -> tuple[list[float], list[Any]]:
    """One job: its step times (from step 2's record on) and the moves it made."""
    from swarm_core.config.schemas import ModelConfig, TrainingConfig
    from swarm_core.contract import JobSubmit, Topology
    from swarm_core.protocol import SetSpeedRequest
    from swarm_core.schema import structure

    fellows = sorted(f.fellow_id for f in await c.fellows())
    for fid in fellows:  # (every fellow padded, before the job is placed)
        await c.set_speed(fid, SetSpeedRequest(slowdown=pad), link=False)
    topo = Topology(stages=STAGES, replicas=REPLICAS, wiring="swarm", routing="measured",
                    rebalance_every=every)
    job = await c.submit(JobSubmit(
        name=f"rebalance-{every or 'off'}", kind="train",
        model=structure(cfg["model"], ModelConfig),
        training=structure({"steps": cfg["steps"], "batch_size": cfg["batch"],
                            "micro_batches": cfg["micro"], "eval_batches": 0,
                            "warmup_steps": 0, "frame_timeout_s": 60.0, "seed": 5},
                           TrainingConfig),
        topology=topo))
    job = await c.wait_job(job.job_id, 0.1, until=lambda j: j.placement is not None)
    assert job.placement is not None, job.reason
    for stage, rid in SLOWED:
        fid = job.placement.cell(stage, rid).fellow_id
        await c.set_speed(fid, SetSpeedRequest(slowdown=pad * SLOW), link=False)
    job = await c.wait_job(job.job_id)
    if job.state != "COMPLETED":
        raise RuntimeError(f"job {job.job_id} {job.state}: {job.reason}")
    records = sorted(await c.progress(job.job_id), key=lambda r: r.step)
    stamps = [r.ts for r in records]
    return ([b - a for a, b in itertools.pairwise(stamps)],
            [ch.moved for ch in job.membership if ch.moved is not None])


def table(cfg: dict[str, Any], pad: float) -> None:
    from swarm_core.client import SwarmClient
    from swarm_core.local_cluster import ClusterSpec, start_cluster, stop_cluster, token_for

    record = start_cluster(ClusterSpec(fellows=STAGES * REPLICAS, timeout_s=180))

    async def body() -> tuple[tuple[list[float], list[Any]], tuple[list[float], list[Any]]]:
        async with SwarmClient(record.leader_url, token_for(record)) as c:
            return (await run_job(c, cfg, pad, None),
                    await run_job(c, cfg, pad, cfg["every"]))

    try:
        (off, _none), (on, moves) = asyncio.run(body())
    finally:
        stop_cluster()
    every, steps = cfg["every"], cfg["steps"]
    print(f"== rebalancing across {STAGES * REPLICAS} fellow processes: S={STAGES} x "
          f"R={REPLICAS}, stage 1's ids {[r for _k, r in SLOWED]} slowed {SLOW:g}x, measured "
          f"routes, every fellow padded {pad:g}x, a look every {every} steps ==")
    # (off[i]: from step i+1's record to step i+2's)
    flat = statistics.mean(off[1:])
    print(f"no rebalancing: {flat:.3f} s/step (steps 3-{steps})")
    if not moves:
        print("rebalancing: no move made (target >= 1.3x: NOT MET)")
        return
    bounds = [0, *(m.at for m in moves), steps]
    phases = []
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        first = lo + 1 if i == 0 else lo + 2
        got = on[first:hi - 1]
        if got:  # (on[first] is step first + 2's time, 1-based; the last is step hi's)
            phases.append((first + 2, hi, statistics.mean(got)))
    print(f"  {'moves so far':<36} {'steps':>8} {'s/step':>8} {'vs before':>10}")
    names = ["none"] + [f"{m.source}.{m.cell} -> {m.target}.{m.new_id} @{m.at}" for m in moves]
    for (lo, hi, mean), name in zip(phases, names, strict=False):
        print(f"  {name:<36} {f'{lo}-{hi}':>8} {mean:>8.3f} {phases[0][2] / mean:>9.2f}x")
    for m in moves:  # (left out of the phases: the move's step and the two after it)
        around = on[m.at - 1:m.at + 2]  # (steps at+1 .. at+3, 1-based)
        print(f"  steps {m.at + 1}-{m.at + 3} around the move @{m.at}: "
              + " ".join(f"{t:.3f}" for t in around) + " s")
    before, after = phases[0][2], phases[-1][2]
    gain = before / after
    print(f"target: throughput after rebalancing >= 1.3x before: {gain:.2f}x at its last "
          f"layout ({'MET' if gain >= 1.3 else 'NOT MET'}); the last against no "
          f"rebalancing: {flat / after:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 8 steps")
    ap.add_argument("--pad", type=float, default=4.0,
                    help="every fellow's padding (default 4; the slowed ones 4 x this)")
    ap.add_argument("--steps", type=int, help="steps a job (default 24; quick 8)")
    ap.add_argument("--every", type=int, help="steps between looks (default 8; quick 3)")
    args = ap.parse_args()
    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: v for k, v in (("steps", args.steps), ("every", args.every)) if v})
    with tempfile.TemporaryDirectory(prefix="swarm-rebalance-") as home:
        os.environ["SWARM_HOME"] = home  # its own local cluster, not the user's
        table(cfg, 1.0 if args.quick else args.pad)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
