"""One run's prediction from end to end (calibrate, plan the syncs, predict), and its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from swarm_core.predict.calibrate import Measure, StageWork, calibrate, stage_works
from swarm_core.predict.critical_path import StageTimes
from swarm_core.predict.rebalance import RebalanceStep, plan_moves, rebalances
from swarm_core.predict.step import Prediction, RunShape, predict
from swarm_core.predict.sync_plan import sync_bytes_per_step


@attrs.frozen
class PredictedRun:
    prediction: Prediction
    calibrated: bool  # False: every stage's times came from the cache
    # A rebalancing run's moves, look by look, each with the run's prediction after it (None:
    # the run does not rebalance; empty: its rule finds no move).
    rebalance: list[tuple[RebalanceStep, Prediction]] | None = None


def predict_run(shape: RunShape, cache: Path | None = None, force: bool = False,
                measure: Measure | None = None) -> PredictedRun:
    works = stage_works(shape.model, shape.training, shape.stages, shape.replicas)
    cal = calibrate(works, cache, force, measure)
    moves = [(m, _predicted(m.shape, works, cal.times)) for m in plan_moves(shape, cal.times)]
    return PredictedRun(_predicted(shape, works, cal.times), not all(cal.cached),
                        moves if rebalances(shape) else None)


def _predicted(shape: RunShape, works: list[StageWork], times: list[StageTimes]
               ) -> Prediction:
    """``shape``'s prediction, each stage's ring its own cells (a layout's sizes)."""
    sync = sync_bytes_per_step(works, shape.replicas,
                               [shape.ids(s) for s in range(shape.stages)], shape.placed)
    return predict(shape, times, sync)


def prediction_json(run: PredictedRun) -> dict[str, Any]:
    """``swarm predict --format json``: one run. ``step_seconds`` is the predicted step (the
    schedule played out), ``step_seconds_overlap`` its perfect-overlap lower bound; each
    link's ``mbps_for`` is a perfect-overlap figure."""
    p = run.prediction
    return {"run": p.run, "network": p.network, "schedule": p.schedule,
            "step_seconds": p.step_seconds, "step_seconds_overlap": p.step_seconds_overlap,
            "step_seconds_no_overlap": p.step_seconds_no_overlap,
            "latency_seconds": p.latency_seconds,
            "compute_seconds": p.compute_seconds, "utilisation": p.utilisation,
            "bound_by": p.bound_by, "bound_kind": p.bound_kind, "calibrated": run.calibrated,
            "stages": [{"stage": s.stage, "compute_seconds": s.compute_seconds,
                        "utilisation": s.utilisation} for s in p.stages],
            "deals": [{str(r): n for r, n in deal.items()} for deal in p.deals],
            "rebalance": None if run.rebalance is None else [
                {"at": m.move.at, "move": m.move.cells(),
                 "layout": [m.shape.ids(s) for s in range(m.shape.stages)],
                 "step_seconds": after.step_seconds,
                 "deals": [{str(r): n for r, n in deal.items()} for deal in after.deals]}
                for m, after in run.rebalance],
            "links": [{"name": x.name, "bytes_per_step": x.nbytes,
                       "seconds_per_step": x.seconds, "bound": x.bound, "mbps": x.mbps,
                       "latency_ms": x.latency_s * 1000.0, "carries": list(x.carries),
                       "mbps_for": x.mbps_for} for x in p.links]}
