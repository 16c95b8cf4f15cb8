#!/usr/bin/env python3
"""The predictor against measured steps over the network scenario library (issue 40 point 5's
target: within 15 %; a benchmark, not a test).

For each library scenario (exp/configs/network/*.json) and 2 and 3 stages: the pipeline of
bench_pair_links.py's step model (d_model 256, MLP ratio 1, seq 128, batch 16, 1f1b, 4
micro-batches, one torch thread a stage) in threads of this process over loopback TCP, every
peer link shaped by the scenario (its matrix through ``training.network``; its uniform rates
and latency on each cell's own shaper, as a fellow's set-speed would), the cells at the
scenario's sites round robin. Measured: the mean interval between stage 0's steps (first
skipped). Predicted, from ``measure_stage`` timings taken in this run: the predicted step
(``step_seconds``, the schedule played out with whole frames at each pair's rate and latency)
and its perfect-overlap lower bound (``step_seconds_overlap``). Ratio measured / each; the
target is read against the predicted step.

    .venv/bin/python bench/bench_predict_scenarios.py            # 6 measured steps a run
    .venv/bin/python bench/bench_predict_scenarios.py --quick    # 2 scenarios, 2 steps
    .venv/bin/python bench/bench_predict_scenarios.py --fellows  # as a cluster runs them

``--fellows``: the same jobs submitted to a local leader and three fellow processes (one
cell each, a torch thread each), the matrix and the uniform limits as the job's
``training.network`` and ``training.link``; measured: stage 0's own step seconds (its
reports' ``stage_seconds``, first step skipped). Threads of one process also take turns at
one interpreter lock, which fellows do not: this mode measures the step a researcher's
cluster runs.

Only 127.0.0.1 (the cluster is a local one under a temporary SWARM_HOME). The stages share
this machine's cores either way, so the prediction is told so (``RunShape.cores``): where the
stages outnumber them, each op also waits for a core (the timings are one stage alone).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

from swarm_core.config.profiles import load_network_scenario  # noqa: E402
from swarm_core.config.schemas import ModelConfig, TrainingConfig  # noqa: E402
from swarm_core.data import load_token_data  # noqa: E402
from swarm_core.pipeline.links import LinkShaper  # noqa: E402
from swarm_core.pipeline.local import run_local_pipeline  # noqa: E402
from swarm_core.predict.calibrate import measure_stage, stage_works  # noqa: E402
from swarm_core.predict.network import network_for  # noqa: E402
from swarm_core.predict.step import RunShape, predict  # noqa: E402
from swarm_core.schema import unstructure  # noqa: E402

MODEL = dict(d_model=256, n_heads=4, seq_len=128, mlp_ratio=1, compression="none")
TARGET = 0.15
SCENARIOS = ["uniform-80mbps", "volunteer-200mbps-80ms", "home-asymmetric-500-110",
             "dtfm-multi-university", "dtfm-regional-us", "dtfm-worldwide", "dtfm-spot",
             "dtfm-datacenter"]


def _setup(name: str, stages: int, steps: int) -> tuple[Any, ModelConfig, TrainingConfig,
                                                         Any]:
    """The scenario, the run's model and training, and the prediction from stage timings
    measured here and now."""
    profile = load_network_scenario(name)
    model = ModelConfig(**MODEL, n_layers=stages)
    training = TrainingConfig(steps=steps + 1, batch_size=16, micro_batches=4,
                              eval_batches=0, warmup_steps=0, frame_timeout_s=60.0, threads=1,
                              network=profile.matrix)
    times = [measure_stage(w) for w in stage_works(model, training, stages, 1)]
    link = profile.link
    # (every stage runs on this machine, in threads or fellows: they share its cores)
    shape = RunShape(name, model, training, stages, 1, network_for(
        {"name": name, **({} if link is None else unstructure(link))}, profile.matrix, stages),
        cores=os.cpu_count())
    return profile, model, training, predict(shape, times)


def _row(name: str, stages: int, pred: Any, step: float) -> dict[str, float | str]:
    return {"scenario": name, "stages": stages, "bound": pred.bound_by, "step": step,
            "overlap": pred.step_seconds_overlap, "pred": pred.step_seconds,
            "compute": pred.compute_seconds}


def one(name: str, stages: int, steps: int) -> dict[str, float | str]:
    """The run in threads of this process."""
    profile, model, training, pred = _setup(name, stages, steps)
    link = profile.link
    shapers = []
    for _ in range(stages):
        shaper = LinkShaper()
        if link is not None:
            shaper.apply(link)
        shapers.append(shaper)
    stamps: list[float] = []
    res = run_local_pipeline(model, training, load_token_data(training, model.seq_len), stages,
                             shapers=shapers, timeout=600,
                             on_step=lambda s, _r: stamps.append(time.perf_counter())
                             if s == 0 else None)
    bad = {s: r for s, r in res.items() if isinstance(r, BaseException)}
    if bad:
        raise RuntimeError(f"{name}: stages failed: {bad}")
    return _row(name, stages, pred, statistics.mean(b - a for a, b in
                                                    itertools.pairwise(stamps)))


async def one_fellows(c: Any, name: str, stages: int, steps: int) -> dict[str, float | str]:
    """The run as a job of the local cluster's fellows (``c``: its client)."""
    from swarm_core.contract import JobSubmit, Topology

    profile, model, training, pred = _setup(name, stages, steps)
    training = attrs.evolve(training, link=profile.link)
    job = await c.submit(JobSubmit(name=f"predict-{name}-{stages}", kind="train", model=model,
                                   training=training,
                                   topology=Topology(stages=stages, replicas=1)))
    job = await c.wait_job(job.job_id, 0.2)
    if job.state != "COMPLETED":
        raise RuntimeError(f"{name}: job {job.job_id} {job.state}: {job.reason}")
    records = sorted(await c.progress(job.job_id), key=lambda r: r.step)
    times = [r.stage_seconds["0"] for r in records if r.step > 1 and r.stage_seconds
             and "0" in r.stage_seconds]
    if not times:
        raise RuntimeError(f"{name}: job {job.job_id} recorded no step time of stage 0")
    return _row(name, stages, pred, statistics.mean(times))


def fellows_rows(grid: list[tuple[str, int]], steps: int) -> list[dict[str, float | str]]:
    """Every run of ``grid`` on a local leader and as many fellows as the deepest needs."""
    from swarm_core.client import SwarmClient
    from swarm_core.local_cluster import ClusterSpec, start_cluster, stop_cluster, token_for

    record = start_cluster(ClusterSpec(fellows=max(n for _s, n in grid), threads=1,
                                       timeout_s=180))

    async def body() -> list[dict[str, float | str]]:
        async with SwarmClient(record.leader_url, token_for(record)) as c:
            return [await one_fellows(c, s, n, steps) for s, n in grid]

    try:
        return asyncio.run(body())
    finally:
        stop_cluster()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 scenarios, 2 stages, 2 steps")
    ap.add_argument("--fellows", action="store_true",
                    help="run each job on a local leader's fellow processes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    scenarios = SCENARIOS[:2] if args.quick else SCENARIOS
    grid = [(s, n) for s in scenarios for n in ((2,) if args.quick else (2, 3))]
    steps = 2 if args.quick else 6
    if args.fellows:
        with tempfile.TemporaryDirectory(prefix="swarm-predict-") as home:
            os.environ["SWARM_HOME"] = home  # its own local cluster, not the user's
            rows = fellows_rows(grid, steps)
    else:
        rows = [one(s, n, steps) for s, n in grid]
    print(f"step measured {'in fellow processes' if args.fellows else 'in threads of this process'}"
          f", {os.cpu_count()} cores")
    head = ("scenario", "S", "bound by", "C ms", "overlap ms", "pred ms", "step ms",
            "step/overlap", "step/pred", "within 15%")
    fmt = "  {:<24} {:>2} {:<26} {:>7} {:>10} {:>8} {:>8} {:>12} {:>9} {:>10}"
    print(fmt.format(*head))
    for r in rows:
        ms = {k: float(r[k]) * 1e3 for k in ("compute", "overlap", "pred", "step")}
        print(fmt.format(r["scenario"], r["stages"], str(r["bound"])[:26], f"{ms['compute']:.1f}",
                         f"{ms['overlap']:.1f}", f"{ms['pred']:.1f}", f"{ms['step']:.1f}",
                         f"{ms['step'] / ms['overlap']:.2f}", f"{ms['step'] / ms['pred']:.2f}",
                         "MET" if abs(ms["step"] / ms["pred"] - 1) <= TARGET else "NOT MET"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
