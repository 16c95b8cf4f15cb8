#!/usr/bin/env python3
"""Heterogeneous swarm: chain against swarm wiring with one slow peer (issue 34; a benchmark, not
a test).

S = 2 stages x R = 2 replicas in threads of this process over loopback TCP (run_local_pipeline),
dp sync. Stage 1's replica 1 is slowed 4x by the emulated slowdown (pipeline/pace.py: its
compute padded with sleeps, so it frees its core while it "computes"). Rows, side by side:

* chain / swarm, unslowed: what routing costs where nothing is slow (target <= 3 %);
* chain, unslowed, fused backward: split backward off, as swarm wiring's cells run their
  backwards: the compute per micro-batch the swarm rows' predictions and the capacity bound
  take (a chain's deferred weight passes cost more per micro-batch on a small CPU model);
* swarm regroup-ready, unslowed: as a fellow runs it, with a coordinator, so each cell keeps
  a copy of its state before each optimiser step (a lost cell's step can then be redone);
* chain, slowed: replica 1's chain runs at its slow cell's pace, and the dp average waits for it;
* swarm, slowed, equal weights: routing alone, weights not told of the slow peer;
* swarm, slowed, oracle weights: the route weights set to the cells' speeds (1 and 1/4), as
  SWARM's throughput estimates would converge to (``topology.route_weights``);
* swarm, slowed, measured: ``topology.routing: measured``, the weights SWARM's estimate learns
  in the run (each cell's compute per micro-batch, agreed every step; the first step deals
  equally, before anything is measured). This is the method; the oracle row is its ceiling.

The capacity bound is the slowest stage's summed replica speeds: from the unslowed chain run
with fused backwards, each stage's compute per micro-batch t_k (its step less its link waits
and sync, over its micro-batches), then a step of R x M micro-batches cannot beat
R M / min_k sum_r 1 / (t_k s_kr).
Targets (issue 34): swarm >= 90 % of that bound, and >= 2x chain's throughput, slowed.

    .venv/bin/python bench/bench_hetero.py           # 8 measured steps a row (~3 min)
    .venv/bin/python bench/bench_hetero.py --quick   # 2 measured steps, a tiny model (~20 s)
    .venv/bin/python bench/bench_hetero.py --rebalance-only   # the rebalancing table alone

Then rebalancing (issue 34 point 3): S=2 x R=3, two of stage 1's peers slowed 4x, measured
routes, every cell padded 4x (six cells, two cores), SWARM's rule looking every 8 steps
(``run_local_pipeline(rebalance=)``): the step time before the first move against after it,
beside the same job without rebalancing. Target: >= 1.3x.

Only 127.0.0.1. On a machine of 2 cores the four cells share them: the compute of the fast
cells is contended, which the table's t_k (measured in the same conditions) includes.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

from swarm_core.config.schemas import ModelConfig, TrainingConfig  # noqa: E402
from swarm_core.data import load_token_data  # noqa: E402
from swarm_core.pipeline.local import LocalCoordinator, run_local_pipeline  # noqa: E402
from swarm_core.pipeline.pace import Pace  # noqa: E402
from swarm_core.pipeline.stage import StageResult, StepReport  # noqa: E402
from swarm_core.predict.critical_path import StageTimes, simulate_chains  # noqa: E402
from swarm_core.predict.network import UniformNetwork  # noqa: E402
from swarm_core.predict.routed import RoutedRun, route_weights  # noqa: E402
from swarm_core.predict.service import predict_run  # noqa: E402
from swarm_core.predict.step import RunShape  # noqa: E402

STAGES, REPLICAS, SLOW = 2, 2, 4.0
SLOW_CELL = (1, 1)  # (stage, replica)
FUSED = "chain, unslowed, fused backward"  # (split backward off: as swarm cells run)
# (8 micro-batches a replica: a route deals 16 a step, fine enough for a 4 : 1 split)
FULL = dict(model=dict(d_model=128, n_layers=4, n_heads=4, seq_len=64), batch=32, micro=8,
            steps=8)
QUICK = dict(model=dict(d_model=32, n_layers=2, n_heads=2, seq_len=16), batch=8, micro=2,
             steps=2)


def run(cfg: dict[str, Any], wiring: str, slowed: bool,
        weights: list[list[float]] | None = None, base: float = 1.0,
        routing: str = "given", regroup: bool = False, split: bool = True) -> dict[str, Any]:
    mc = ModelConfig(**cfg["model"])
    # (``split``: a chain's split backward, the job's default; swarm wiring never splits)
    tc = TrainingConfig(steps=cfg["steps"] + 1, batch_size=cfg["batch"],
                        micro_batches=cfg["micro"], eval_batches=0, warmup_steps=0,
                        frame_timeout_s=60.0, seed=5, split_backward=split)
    data = load_token_data(tc, mc.seq_len)
    reports: dict[int, list[tuple[float, StepReport]]] = {c: [] for c in range(STAGES * REPLICAS)}
    slow_index = SLOW_CELL[1] * STAGES + SLOW_CELL[0]
    # ``base``: every cell padded to base x its compute (the slow one to SLOW x that), so
    # each computes a base-th of its time and four cells do not contend for two cores.
    kwargs = {c: {"pace": Pace(base * (SLOW if slowed and c == slow_index else 1.0))}
              for c in range(STAGES * REPLICAS) if base > 1 or (slowed and c == slow_index)}
    # ``regroup``: with a coordinator, as a fellow runs a job of replicas: swarm wiring's
    # cells then keep a copy of their state before each optimiser step (pipeline/reroute).
    stop = threading.Event()
    coordinator = LocalCoordinator(STAGES, REPLICAS, stop) if regroup else None
    res = run_local_pipeline(mc, tc, data, STAGES, replicas=REPLICAS, wiring=wiring,
                             route_weights=weights, routing=routing,  # type: ignore[arg-type]
                             stage_kwargs=kwargs, timeout=600, stop=stop,
                             coordinator=coordinator,
                             on_step=lambda c, r: reports[c].append((time.perf_counter(), r)))
    bad = {c: r for c, r in res.items() if not isinstance(r, StageResult)}
    if bad:
        raise RuntimeError(f"cells failed: {bad}")
    stamps = [ts for ts, _ in reports[0]]
    step_s = statistics.mean(b - a for a, b in itertools.pairwise(stamps))
    # Each cell's compute per micro-batch (steps after the first): its step less its link
    # waits and its group's sync, over the micro-batches it ran (routed: the plan's).
    per_mb = {}
    for cell, rs in reports.items():
        stage, replica = cell % STAGES, cell // STAGES
        spent, count = 0.0, 0
        for _ts, r in rs[1:]:
            ran = r.micro_batches or cfg["micro"]  # (routed: its route's deal)
            spent += r.seconds - r.wait_seconds - (r.sync_seconds or 0.0)
            count += ran
        per_mb[(stage, replica)] = spent / count
    return {"step_s": step_s, "per_mb": per_mb}


def capacity_step(base: dict[str, Any], micro: int) -> float:
    """The step a perfect router reaches: R M micro-batches at the slowest stage's summed
    speeds (each replica's unslowed compute per micro-batch, times its slowdown)."""
    caps = []
    for k in range(STAGES):
        t = statistics.mean(base["per_mb"][(k, r)] for r in range(REPLICAS))
        caps.append(sum(1.0 / (t * (SLOW if (k, r) == SLOW_CELL else 1.0))
                        for r in range(REPLICAS)))
    return REPLICAS * micro / min(caps)


def predicted(cfg: dict[str, Any], base: dict[str, Any], wiring: str, slowed: bool,
              weights: list[list[float]] | None = None, routing: str = "given",
              scale: float = 1.0, cores: int | None = None) -> float:
    """``swarm predict``'s model of the row (``predict/routed``, ``critical_path``): each
    stage's compute per micro-batch from the unslowed chain row (as the capacity bound takes
    it; a third forward, two thirds backward), times ``scale``, the slow cell at SLOW times
    it, transfers free. ``cores`` None: each cell on a core of its own (a table's contention
    is then in the measured times); else every cell's ops share that many cores, a slowed
    cell's padding slept off them (``swarm predict --cores``)."""
    tc = TrainingConfig(batch_size=cfg["batch"], micro_batches=cfg["micro"], seed=5)
    times = []
    for k in range(STAGES):
        t = statistics.mean(base["per_mb"][(k, r)] for r in range(REPLICAS)) * scale
        times.append(StageTimes(t / 3, 2 * t / 3))
    slow = {SLOW_CELL: SLOW} if slowed else {}
    if wiring == "chain":
        chains = [[attrs.evolve(st, pace=slow.get((k, r), 1.0)) for k, st in enumerate(times)]
                  for r in range(REPLICAS)]
        return simulate_chains(tc.schedule, chains, cfg["micro"], cores=cores)
    deal = route_weights(STAGES, REPLICAS, routing, weights, slow)
    return RoutedRun.of(tc.seed, STAGES, REPLICAS, cfg["micro"], times, deal, slow,
                        cores=cores).step()


Spec = tuple[str, dict[str, Any]]


def calibration(rows: dict[str, dict[str, Any]], name: str, spec: dict[str, Any]
                ) -> dict[str, Any]:
    """The unslowed chain row a row is predicted from: the one whose backwards it runs (a
    chain splits its backward, the default; swarm wiring's cells do not, and a split
    backward's compute per micro-batch is not a fused one's: 15-30 % more at this model on a
    2-core machine, the 2026-12-08 runs in decisions.md)."""
    split = spec["wiring"] == "chain" and spec.get("split", True)
    return rows["chain, unslowed" if split else FUSED]


def model_args(spec: dict[str, Any]) -> dict[str, Any]:
    """A row's spec as ``predicted`` takes it (how it ran, not what it models, left out)."""
    return {k: v for k, v in spec.items() if k not in ("regroup", "split")}


def table(cfg: dict[str, Any], base: float) -> tuple[list[Spec], dict[str, dict[str, Any]]]:
    oracle = [[1.0, 1.0], [1.0, 1.0 / SLOW]]
    specs = [("chain, unslowed", dict(wiring="chain", slowed=False)),
             (FUSED, dict(wiring="chain", slowed=False, split=False)),
             ("swarm, unslowed", dict(wiring="swarm", slowed=False)),
             ("swarm regroup-ready, unslowed", dict(wiring="swarm", slowed=False,
                                                     regroup=True)),
             ("chain, slowed 4x", dict(wiring="chain", slowed=True)),
             ("swarm, slowed, equal weights", dict(wiring="swarm", slowed=True)),
             ("swarm, slowed, oracle weights", dict(wiring="swarm", slowed=True,
                                                    weights=oracle)),
             ("swarm, slowed, measured", dict(wiring="swarm", slowed=True,
                                              routing="measured"))]
    rows = {name: run(cfg, base=base, **spec) for name, spec in specs}  # type: ignore[arg-type]
    split_row, fused_row = rows["chain, unslowed"], rows[FUSED]
    for name, spec in specs:
        rows[name]["predicted"] = predicted(cfg, calibration(rows, name, spec),
                                            **model_args(spec))
    # (the bound is the swarm rows': their cells' compute, fused backwards)
    bound = capacity_step(fused_row, cfg["micro"])
    chain_slow = rows["chain, slowed 4x"]["step_s"]
    print(f"\n== every cell padded to {base:g}x its compute (the slow one {base * SLOW:g}x) ==" if
          base > 1 else "\n== raw: the four cells share this machine's cores ==")
    for label, row in (("split backward", split_row), ("fused backward", fused_row)):
        t_ms = [statistics.mean(row["per_mb"][(k, r)] for r in range(REPLICAS)) * 1e3
                for k in range(STAGES)]
        print(f"t_k (unslowed chain, {label}, compute per micro-batch): "
              + ", ".join(f"stage {k} {t:.1f} ms" for k, t in enumerate(t_ms)))
    print(f"capacity bound, slowed: {bound:.3f} s/step (fused backwards, as swarm cells run)")
    head = ("row", "s/step", "x chain slowed", "of capacity", "vs chain unslowed",
            "predicted", "measured/pred")
    print("  ".join(f"{h:>18}" if i else f"{h:<32}" for i, h in enumerate(head)))
    for name, r in rows.items():
        slowed = "unslowed" not in name
        cells = (name, f"{r['step_s']:.3f}",
                 f"{chain_slow / r['step_s']:.2f}x" if slowed else "",
                 f"{bound / r['step_s']:.0%}" if slowed else "",
                 "" if slowed else f"{r['step_s'] / split_row['step_s'] - 1:+.1%}",
                 f"{r['predicted']:.3f}", f"{r['step_s'] / r['predicted']:.2f}")
        print("  ".join(f"{c:>18}" if i else f"{c:<32}" for i, c in enumerate(cells)))
    for name in ("oracle weights", "measured"):
        best = rows[f"swarm, slowed, {name}"]["step_s"]
        name = name.split()[0]
        print(f"targets, {name}: swarm >= 90% of capacity: {bound / best:.0%} "
              f"({'MET' if bound / best >= 0.9 else 'NOT MET'}); swarm >= 2x chain, slowed: "
              f"{chain_slow / best:.2f}x ({'MET' if chain_slow / best >= 2 else 'NOT MET'})")
    for name, row in (("", rows["swarm, unslowed"]),
                      (", regroup-ready", rows["swarm regroup-ready, unslowed"])):
        cost = row["step_s"] / split_row["step_s"]
        print(f"target: unslowed cost{name} <= 3%: {cost - 1:+.1%} "
              f"({'MET' if cost <= 1.03 else 'NOT MET'}; against the chain's fused backward "
              f"{row['step_s'] / fused_row['step_s'] - 1:+.1%})")
    return specs, rows


def cores_table(cfg: dict[str, Any], specs: list[Spec], raw: dict[str, dict[str, Any]],
                padded: dict[str, dict[str, Any]], base: float) -> None:
    """The raw table's rows as ``swarm predict --cores`` plays them: the four cells' ops on
    this machine's cores, a slowed cell's padding slept off them (so the others compute
    meanwhile), each stage's compute taken from the padded table (its time per micro-batch
    over the padding: cells computing a third of their time barely contend)."""
    cores = os.cpu_count() or 1
    print(f"\n== the raw rows on {cores} cores, predicted from the padded table's compute "
          f"(per micro-batch / {base:g}) ==")
    print(f"{'row':<32}  {'s/step':>10}  {'predicted':>10}  {'measured/pred':>14}")
    for name, spec in specs:
        pred = predicted(cfg, calibration(padded, name, spec), scale=1.0 / base, cores=cores,
                         **model_args(spec))
        step = raw[name]["step_s"]
        print(f"{name:<32}  {step:>10.3f}  {pred:>10.3f}  {step / pred:>14.2f}")


# Rebalancing (issue 34 point 3): S=2 x R=3, two stage-1 peers slowed 4x: stage 1 does
# 1 + 1/4 + 1/4 = 1.5 of stage 0's 3 units; a stage-0 peer moved there makes 2 : 2.5 (4/3).
RB_REPLICAS, RB_SLOW = 3, (1, 2)  # (stage-1 ids slowed)
RB_FULL = dict(model=FULL["model"], batch=48, micro=8, steps=24, every=8)
RB_QUICK = dict(model=QUICK["model"], batch=12, micro=2, steps=8, every=3)


def run_rebalance(cfg: dict[str, Any], base: float, every: int | None) -> dict[str, Any]:
    """Swarm wiring, measured routes, every cell padded to ``base`` x its compute (the slowed
    ones SLOW x that); ``every``: rebalancing's look every that many steps (None: off). The
    step times of cell 0 of stage 0 (it never moves), and the moves made."""
    mc = ModelConfig(**cfg["model"])
    tc = TrainingConfig(steps=cfg["steps"], batch_size=cfg["batch"],
                        micro_batches=cfg["micro"], eval_batches=0, warmup_steps=0,
                        frame_timeout_s=60.0, seed=5)
    data = load_token_data(tc, mc.seq_len)
    stamps: list[float] = []
    moves: list[Any] = []
    kwargs = {r * STAGES + k: {"pace": Pace(base * (SLOW if k == 1 and r in RB_SLOW else 1.0))}
              for k in range(STAGES) for r in range(RB_REPLICAS)
              if base > 1 or (k == 1 and r in RB_SLOW)}

    def on_step(cell: int, _rep: StepReport) -> None:
        if cell == 0:
            stamps.append(time.perf_counter())

    res = run_local_pipeline(mc, tc, data, STAGES, replicas=RB_REPLICAS, wiring="swarm",
                             routing="measured", rebalance=every, stage_kwargs=kwargs,
                             timeout=900, on_step=on_step, on_move=moves.append)
    bad = {c: r for c, r in res.items() if not isinstance(r, StageResult)}
    if bad:
        raise RuntimeError(f"cells failed: {bad}")
    return {"steps": [b - a for a, b in itertools.pairwise(stamps)], "moves": moves}


def predicted_rebalancing(cfg: dict[str, Any]) -> list[tuple[str, int, float]]:
    """What ``swarm predict`` expects of the rebalancing job: each move its rule makes and
    the step before any over the step after it (``predict/rebalance``; the padding every
    cell shares scales every step alike, so the cells are taken as machines, unpadded)."""
    tc = TrainingConfig(steps=cfg["steps"], batch_size=cfg["batch"], micro_batches=cfg["micro"],
                        eval_batches=0, warmup_steps=0, seed=5)
    shape = RunShape("rebalance", ModelConfig(**cfg["model"]), tc, STAGES, RB_REPLICAS,
                     UniformNetwork("unshaped"), wiring="swarm", routing="measured",
                     slowdowns=tuple((1, r, SLOW) for r in RB_SLOW),
                     rebalance_every=cfg["every"])
    done = predict_run(shape)
    first = done.prediction.step_seconds
    return [(m.move.cells(), m.move.at, first / after.step_seconds)
            for m, after in done.rebalance or ()]


def rebalance_table(cfg: dict[str, Any], base: float) -> None:
    """Throughput before the first move against after it (its step, the re-link and the
    first step after left out: before measured routes kept their estimate across a move,
    that step dealt equally), beside the same job without rebalancing."""
    every = cfg["every"]
    # (first, in the main thread: torch's calibration there after the runs' threads ended
    # aborted the interpreter at exit in 1 of 3 runs, "terminate called without an active
    # exception"; before them, 0 of 5)
    expected = predicted_rebalancing(cfg)
    off = run_rebalance(cfg, base, None)
    on = run_rebalance(cfg, base, every)
    print(f"\n== rebalancing: S={STAGES} x R={RB_REPLICAS}, stage 1's ids {list(RB_SLOW)} "
          f"slowed {SLOW:g}x, measured routes, every cell padded {base:g}x, a look every "
          f"{every} steps ==")
    # (step i of ``steps`` is the time from step i+1's report to step i+2's, 0-based)
    flat = statistics.mean(off["steps"][1:])
    print(f"no rebalancing: {flat:.3f} s/step (steps 3-{cfg['steps']})")
    if not on["moves"]:
        print("rebalancing: no move made (target >= 1.3x: NOT MET)")
        return
    # Phases between moves: each move's step and the next left out (the move's re-link and
    # hand-off, then the step that once dealt equally; kept out so runs stay comparable).
    bounds = [0, *(m.at for m in on["moves"]), cfg["steps"]]
    phases = []
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        first = lo + 1 if i == 0 else lo + 2  # (0-based step index into steps)
        steps = on["steps"][first:hi - 1]
        if steps:
            phases.append((lo, hi, statistics.mean(steps)))
    layouts = ["uniform"] + [str(m.after) for m in on["moves"]]
    print(f"  {'layout':<28} {'steps':>8} {'s/step':>8} {'vs before':>10}")
    for (lo, hi, mean), name in zip(phases, layouts, strict=False):
        print(f"  {name:<28} {f'{lo + 1}-{hi}':>8} {mean:>8.3f} "
              f"{phases[0][2] / mean:>9.2f}x")
    before, after = phases[0][2], phases[-1][2]
    best = min(mean for _lo, _hi, mean in phases[1:]) if len(phases) > 1 else before
    gain = before / after  # (judged on where rebalancing left the job: its last layout)
    print("predicted (swarm predict's play of the rule on this machine's calibrated compute, "
          "every cell on a machine of its own): " + ("no move" if not expected else "; ".join(
              f"{text} before step {at}, {ratio:.2f}x" for text, at, ratio in expected)))
    print(f"target: throughput after rebalancing >= 1.3x before: {gain:.2f}x at its last "
          f"layout ({'MET' if gain >= 1.3 else 'NOT MET'}; {before / best:.2f}x at its best; "
          f"the rule's units: 1.5 -> 2.0 = 1.33x for one move); the last against no "
          f"rebalancing: {flat / after:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 measured steps")
    ap.add_argument("--rebalance-only", action="store_true",
                    help="only the rebalancing table (S=2 x R=3)")
    ap.add_argument("--rebalance-pad", type=float, default=4.0,
                    help="the rebalancing table's padding of every cell (default 4: six "
                         "cells computing a quarter of their time on two cores)")
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    print(f"S={STAGES} x R={REPLICAS}, dp, model {cfg['model']}, batch {cfg['batch']} in "
          f"{cfg['micro']} micro-batches a replica, stage 1 replica 1 slowed {SLOW:g}x")
    tables = {base: table(cfg, base)
              for base in (() if args.rebalance_only else (1.0,) if args.quick else (1.0, 3.0))}
    if 1.0 in tables and 3.0 in tables:
        specs, raw = tables[1.0]
        cores_table(cfg, specs, raw, tables[3.0][1], 3.0)
    rebalance_table(RB_QUICK if args.quick else RB_FULL,
                    1.0 if args.quick else args.rebalance_pad)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
