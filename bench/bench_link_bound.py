"""A link-bound pipeline's step against the predictor's perfect overlap (a benchmark, not a test).

Issue "Networks as scenarios", target 5: at 80 Mbit/s and 20 ms, with 2 and 4 stages, a
link-bound job's step within 8 % of what ``swarm predict`` gives for a perfect overlap of
compute and transfer (``step_seconds_overlap``); where it is not, which wait it is.

The stages run in threads of this process, joined by real loopback TCP (as
``bench/bench_links.py`` does), one torch thread each; every stage's tx bucket is at
``--mbps`` with ``--latency-ms`` added to each frame it sends (rx unlimited: each direction is
shaped once, at its sender, as a symmetric link). Model: d_model 256, one layer a stage, seq
128, batch 16, fp32 boundary (``none``): each stage sends 16 x 128 x 256 x 4 bytes a step
each way, 210 ms at 80 Mbit/s, against tens of ms of compute: link-bound.

Per row (stages, schedule, micro-batches): the measured step (mean interval between stage 0's
step completions, the first step skipped), the same run unshaped (its compute), and the
predictor on the same job body with ``cores`` = this machine's (the stages share it, as
here): perfect overlap, the schedule played out with each frame queued on its link
(``step_seconds``), and the compute path C. Where the step is over 1.08x perfect overlap, the
wait column says where stage 0's and the last stage's time went (blocked on frames or on
their own sends, against compute) and the played-out prediction says how much the schedule
itself explains.

Usage::

    .venv/bin/python bench/bench_link_bound.py                 # 2 and 4 stages, eager M=16
                                                               # and 1f1b M=4, 6 steps
    .venv/bin/python bench/bench_link_bound.py --quick         # 2 stages, eager, 1 step

Only 127.0.0.1; every run is bounded by frame timeouts and a join timeout.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

from swarm_core.config.schemas import ModelConfig, TrainingConfig  # noqa: E402
from swarm_core.data import TokenData, load_token_data  # noqa: E402
from swarm_core.pipeline.links import LinkShaper, TokenBucket  # noqa: E402
from swarm_core.pipeline.local import run_local_pipeline  # noqa: E402
from swarm_core.pipeline.stage import StepReport  # noqa: E402
from swarm_core.predict.network import UniformNetwork  # noqa: E402
from swarm_core.predict.service import predict_run  # noqa: E402
from swarm_core.predict.step import RunShape  # noqa: E402

TARGET = 1.08
BATCH = 16
RUN_TIMEOUT_S = 240.0


def _model(stages: int) -> ModelConfig:
    return ModelConfig(d_model=256, n_layers=stages, n_heads=4, seq_len=128,
                       compression="none")


def _training(steps: int, schedule: str, micro: int) -> TrainingConfig:
    return TrainingConfig(steps=steps + 1, batch_size=BATCH, micro_batches=micro,
                          schedule=schedule, eval_batches=0, warmup_steps=0,
                          frame_timeout_s=30.0, threads=1)


def run(mc: ModelConfig, tc: TrainingConfig, data: TokenData, stages: int,
        mbps: float | None, latency_ms: float) -> dict[str, Any]:
    """One run: the step (stage 0's completions, first skipped) and each stage's mean
    seconds a step and seconds blocked on its links."""
    reports: dict[int, list[tuple[float, StepReport]]] = {s: [] for s in range(stages)}
    shapers = None if mbps is None else [
        LinkShaper(tx=TokenBucket(mbps), latency_s=latency_ms / 1000.0) for _ in range(stages)]
    results = run_local_pipeline(mc, tc, data, stages, shapers=shapers,
                                 on_step=lambda s, r: reports[s].append((time.perf_counter(), r)),
                                 timeout=RUN_TIMEOUT_S)
    for s in range(stages):
        if isinstance(results.get(s), BaseException):
            raise RuntimeError(f"stage {s} failed: {results[s]!r}") from results[s]
    stamps = [ts for ts, _ in reports[0]]
    return {"step": statistics.mean(b - a for a, b in itertools.pairwise(stamps)),
            "seconds": [statistics.mean(r.seconds for _, r in reports[s][1:])
                        for s in range(stages)],
            "wait": [statistics.mean(r.wait_seconds for _, r in reports[s][1:])
                     for s in range(stages)]}


def row(stages: int, schedule: str, micro: int, steps: int, mbps: float, latency_ms: float,
        data: TokenData, cache: Path, calibrate: bool) -> dict[str, Any]:
    mc, tc = _model(stages), _training(steps, schedule, micro)
    shaped = run(mc, tc, data, stages, mbps, latency_ms)
    free = run(mc, tc, data, stages, None, 0.0)
    shape = RunShape(name=f"{stages} stages {schedule} M={micro}", model=mc, training=tc,
                     stages=stages, replicas=1,
                     network=UniformNetwork(f"{mbps:g}mbit-{latency_ms:g}ms", tx_mbps=mbps,
                                            rx_mbps=None, latency_ms=latency_ms),
                     cores=os.cpu_count())
    p = predict_run(shape, cache, calibrate).prediction
    return {"stages": stages, "schedule": schedule, "micro": micro, "shaped": shaped,
            "free": free, "overlap": p.step_seconds_overlap, "played": p.step_seconds,
            "compute": p.compute_seconds, "bound_by": p.bound_by}


def verdict(r: dict[str, Any]) -> str:
    ratio = r["shaped"]["step"] / r["overlap"]
    if r["bound_by"] == "compute":
        return "n/a: compute-bound"
    if ratio <= TARGET:
        return "MET"
    last = r["stages"] - 1
    sh = r["shaped"]
    waits = ", ".join(f"s{s} waits {sh['wait'][s] / sh['seconds'][s]:.0%}"
                      for s in (0, last))
    explained = r["played"] / r["overlap"]
    return f"MISSED: {waits}; the schedule played out explains {explained:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 stages, eager M=16, 1 step")
    ap.add_argument("--stages", default="2,4", help="comma-separated stage counts")
    ap.add_argument("--mbps", type=float, default=80.0)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=None, help="measured steps (one more runs)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the compute again (default: a fresh cache of this run's)")
    args = ap.parse_args()
    steps = args.steps or (1 if args.quick else 6)
    stage_counts = [2] if args.quick else [int(s) for s in args.stages.split(",")]
    cases = [("eager", 16)] if args.quick else [("eager", 16), ("1f1b", 4)]
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; torch "
          f"{torch.__version__}; d_model 256, one layer a stage, seq 128, batch {BATCH}; "
          f"{args.mbps:g} Mbit/s tx and {args.latency_ms:g} ms a frame on every stage; "
          f"{steps} measured steps (+1 skipped) per run")
    data = load_token_data(TrainingConfig(), 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # (a calibration of its own, taken now on this machine's load, not an older cache)
        cache = Path(tmp) / "calibration.json"
        for stages in stage_counts:
            for schedule, micro in cases:
                rows.append(row(stages, schedule, micro, steps, args.mbps, args.latency_ms,
                                data, cache, args.calibrate))
    header = ("stages", "schedule", "M", "step ms", "overlap ms", "step/overlap",
              "played ms", "step/played", "unshaped ms", "C ms", f"<= {TARGET:.2f}x overlap")
    body = [(str(r["stages"]), r["schedule"], str(r["micro"]),
             f"{r['shaped']['step'] * 1e3:.1f}", f"{r['overlap'] * 1e3:.1f}",
             f"{r['shaped']['step'] / r['overlap']:.2f}", f"{r['played'] * 1e3:.1f}",
             f"{r['shaped']['step'] / r['played']:.2f}", f"{r['free']['step'] * 1e3:.1f}",
             f"{r['compute'] * 1e3:.1f}", verdict(r)) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths[:-1]) + "  {}"
    print(fmt.format(*header))
    for b in body:
        print(fmt.format(*b))
    print(f"(overlap: the predictor's perfect overlap of compute and transfer, its compute "
          f"measured here with {os.cpu_count()} cores shared by the stages; played: the "
          f"schedule played out, each frame queued on its link; load average now "
          f"{os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
