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

    .venv/bin/python bench/bench_predict_scenarios.py          # 6 measured steps a run
    .venv/bin/python bench/bench_predict_scenarios.py --quick  # 2 scenarios, 2 steps

Only 127.0.0.1. Every stage runs in this process, so the prediction is told they share this
machine's cores (``RunShape.cores``): where the stages outnumber them, each op also waits for
a core (the timings are one stage alone).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

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


def one(name: str, stages: int, steps: int) -> dict[str, float | str]:
    profile = load_network_scenario(name)
    model = ModelConfig(**MODEL, n_layers=stages)
    training = TrainingConfig(steps=steps + 1, batch_size=16, micro_batches=4,
                              eval_batches=0, warmup_steps=0, frame_timeout_s=60.0, threads=1,
                              network=profile.matrix)
    times = [measure_stage(w) for w in stage_works(model, training, stages, 1)]
    link = profile.link
    # (every stage runs in this process: they share this machine's cores)
    shape = RunShape(name, model, training, stages, 1, network_for(
        {"name": name, **({} if link is None else unstructure(link))}, profile.matrix, stages),
        cores=os.cpu_count())
    pred = predict(shape, times)
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
    step = statistics.mean(b - a for a, b in itertools.pairwise(stamps))
    return {"scenario": name, "stages": stages, "bound": pred.bound_by, "step": step,
            "overlap": pred.step_seconds_overlap, "pred": pred.step_seconds,
            "compute": pred.compute_seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 scenarios, 2 stages, 2 steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    scenarios = SCENARIOS[:2] if args.quick else SCENARIOS
    grid = [(s, n) for s in scenarios for n in ((2,) if args.quick else (2, 3))]
    rows = [one(s, n, 2 if args.quick else 6) for s, n in grid]
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
