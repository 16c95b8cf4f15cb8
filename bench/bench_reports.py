"""How far a fast job's step reports fall behind its training (a benchmark, not a test).

A tiny model trains hundreds of steps a second; each cell reports every step to the leader,
which stores the step's record before it answers. Reported one by one, a leader on this
machine takes about 600 reports a second (issue 40's churn bench saw its fellows' reports
16-24 s behind the training), so a job of 2 stages x 3 replicas at 200 steps a second fell
ever further behind. The fellows now send what queued while a report was in flight as one
batch (``POST /jobs/{id}/statuses``, stored in one transaction).

For each way of sending, this starts a real leader subprocess on 127.0.0.1 (bench_leader's),
registers six fellows, submits a 2 x 3 train job and drives each cell's reports through the
fellows' own code (``fellow.train.StepReporter`` over ``SwarmClient``), a step every
1/``--rate`` seconds for ``--seconds``; it prints, side by side: the reports the leader took a
second, the lag of the last step (from its step ending to its report answered) and the
leader's CPU. Rows: one by one (the reporter without its batch call) and batched.

Usage::

    .venv/bin/python bench/bench_reports.py              # 200 steps/s a cell, 10 s
    .venv/bin/python bench/bench_reports.py --quick      # a smoke run, a few seconds

Only ever talks to 127.0.0.1. Heavy work beside it on the 2 cores skews every row.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere
sys.path.insert(0, str(REPO / "bench"))

from bench_leader import leader_process, proc_cpu_s  # noqa: E402

from swarm_core.client import SwarmClient  # noqa: E402
from swarm_core.contract import JobStatusUpdate, JobSubmit  # noqa: E402
from swarm_core.contract.heartbeat import CellRef, Heartbeat  # noqa: E402
from swarm_core.fellow.jobs import JobContext, Progress  # noqa: E402
from swarm_core.fellow.train import StepReporter  # noqa: E402
from swarm_core.pipeline.stage import StepReport  # noqa: E402
from swarm_core.protocol import RegisterRequest  # noqa: E402
from swarm_core.schema import structure  # noqa: E402

STAGES, REPLICAS = 2, 3


async def _cell(client: SwarmClient, job_id: str, reg, stage: int, replica: int,
                batched: bool, rate: float, seconds: float) -> tuple[int, float]:
    """One cell's steps at ``rate`` a second for ``seconds``: (steps, the last one's lag)."""
    sent_at: dict[int, float] = {}
    answered: dict[int, float] = {}

    async def report(upd: JobStatusUpdate) -> None:
        await client.job_status(job_id, reg.session, upd)
        answered[upd.step] = time.perf_counter()

    async def report_steps(updates: list[JobStatusUpdate]) -> None:
        await client.job_statuses(job_id, reg.session, updates)
        now = time.perf_counter()
        answered.update({u.step: now for u in updates})

    ctx = JobContext(fellow_id=reg.fellow_id, progress=Progress(), report=report,
                     report_steps=report_steps if batched else None)
    reporter = StepReporter(SimpleNamespace(stage=stage, replica=replica, attempt=0), ctx,
                            asyncio.get_running_loop())
    running = asyncio.create_task(reporter.run())
    steps = int(rate * seconds)
    t0 = time.perf_counter()
    last = stage == STAGES - 1
    for step in range(1, steps + 1):
        await asyncio.sleep(max(0.0, t0 + step / rate - time.perf_counter()))
        sent_at[step] = time.perf_counter()
        reporter.on_step(StepReport(step=step, loss=3.0 if last else None, seconds=1 / rate,
                                    tokens=256, wire_tx_bytes=4096, lr=1e-3,
                                    sync_tx_bytes=1024, sync_seconds=0.0005))
    await asyncio.sleep(0)  # (on_step's hand-over to the loop, as from a stage thread)
    reporter.close()
    await running
    return steps, answered[steps] - sent_at[steps]


async def _run(batched: bool, rate: float, seconds: float) -> dict[str, float]:
    token = secrets.token_hex(16)
    with leader_process(token, verbose=False) as leader:
        await leader.wait_healthy()
        async with SwarmClient(leader.url, token) as client:
            regs = [await client.register(RegisterRequest(
                name=f"f{i}", instance_id=secrets.token_hex(4),
                data_addr=f"127.0.0.1:{7600 + i}")) for i in range(STAGES * REPLICAS)]
            job = await client.submit(structure({
                "name": "reports", "kind": "train",
                "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
                "training": {"steps": 1_000_000, "batch_size": 6, "micro_batches": 1},
                "topology": {"stages": STAGES, "replicas": REPLICAS}}, JobSubmit))
            by_fellow = {r.fellow_id: r for r in regs}

            async def beat() -> None:  # (the fellows are alive: the job is not failed)
                while True:
                    for c in job.placement.stages:
                        await client.heartbeat(c.fellow_id, by_fellow[c.fellow_id].session,
                                               Heartbeat(status="busy",
                                                         current_job=job.job_id,
                                                         running=[CellRef(job.job_id, c.stage,
                                                                          c.replica)]))
                    await asyncio.sleep(0.5)

            beating = asyncio.create_task(beat())
            cpu0, t0 = proc_cpu_s(leader.pid), time.perf_counter()
            results = await asyncio.gather(*(
                _cell(client, job.job_id, by_fellow[c.fellow_id], c.stage, c.replica, batched,
                      rate, seconds) for c in job.placement.stages))
            wall = time.perf_counter() - t0
            cpu = proc_cpu_s(leader.pid) - cpu0
            beating.cancel()
    reports = sum(n for n, _lag in results)
    return {"reports/s": reports / wall, "lag s": max(lag for _n, lag in results),
            "leader cpu %": 100 * cpu / wall, "wall s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0, help="steps a second, per cell")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="50 steps/s for 2 s")
    args = ap.parse_args()
    rate, seconds = (50.0, 2.0) if args.quick else (args.rate, args.seconds)
    print(f"{STAGES} x {REPLICAS} cells, {rate:g} steps/s each ({rate * STAGES * REPLICAS:g} "
          f"reports/s offered), {seconds:g} s of steps")
    rows = [("one by one", asyncio.run(_run(False, rate, seconds))),
            ("batched", asyncio.run(_run(True, rate, seconds)))]
    print(f"{'reports':<12} {'reports/s':>10} {'lag s':>8} {'leader cpu %':>13} {'wall s':>7}")
    for name, r in rows:
        print(f"{name:<12} {r['reports/s']:>10.0f} {r['lag s']:>8.2f} "
              f"{r['leader cpu %']:>13.0f} {r['wall s']:>7.1f}")
    one, many = rows[0][1], rows[1][1]
    print(f"batched / one by one: reports/s {many['reports/s'] / one['reports/s']:.2f}x; "
          f"the last step's lag {one['lag s']:.2f} s -> {many['lag s']:.2f} s")


if __name__ == "__main__":
    main()
