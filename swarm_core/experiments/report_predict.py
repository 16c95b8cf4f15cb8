"""The report's predictor section (issue 40 point 5): what ``swarm predict`` gives for each run's
own resolved config, beside the step the run measured.

A report reads stage times from the calibration cache only. Measuring them here would spend
minutes of CPU inside a report and time this machine, which may not be the one the run trained
on; ``calibrate=True`` (``swarm report --calibrate``) opts in.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from swarm_core import jsonio
from swarm_core.config.schemas import job_shape_error
from swarm_core.contract import JobSubmit
from swarm_core.predict.calibrate import StageWork, default_cache
from swarm_core.predict.critical_path import StageTimes
from swarm_core.predict.network import network_for
from swarm_core.predict.service import predict_run
from swarm_core.predict.step import Prediction, RunShape
from swarm_core.schema import SchemaError, structure, unstructure

NOT_CALIBRATED = "not calibrated on this machine: run swarm predict CONFIG once"
RESOLVED = "config_resolved.json"


class _NotInCache(Exception):
    """A stage the cache lacks, raised by the measure a report passes in its place."""


def _refuse(work: StageWork) -> StageTimes:
    raise _NotInCache(work.stage)


@attrs.frozen
class RunPrediction:
    """One run's row: the predictor's figures (None, with ``why_not``, where there are none)
    and the run's measured mean step."""

    label: str
    measured: float | None
    prediction: Prediction | None = None
    why_not: str | None = None
    # A rebalancing run's moves as the predictor plays its rule (``predict/rebalance``): each
    # move's text, the step it is made before and the step predicted after it.
    moves: list[tuple[str, int, float]] = attrs.field(factory=list)

    @property
    def ratio(self) -> float | None:
        """Measured over predicted (the schedule played out): 1.0 is the prediction met."""
        p = self.prediction
        if p is None or self.measured is None or p.step_seconds <= 0:
            return None
        return self.measured / p.step_seconds


def read_resolved(run_dir: Path) -> dict[str, Any]:
    """The run's ``config_resolved.json``; ValueError, one line, where it cannot be had."""
    try:
        raw = jsonio.loads((run_dir / RESOLVED).read_bytes())
    except FileNotFoundError:
        raise ValueError(f"no {RESOLVED} in the run folder") from None
    except OSError as exc:
        raise ValueError(f"cannot read {RESOLVED}: {exc.strerror}") from None
    except jsonio.JSONDecodeError:
        raise ValueError(f"{RESOLVED} is not valid JSON") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{RESOLVED} holds no JSON object")
    return raw


def resolved_job(resolved: dict[str, Any]) -> JobSubmit:
    """The job the run submitted, checked as the leader checks it (ValueError, one line)."""
    body = resolved.get("job")
    if not isinstance(body, dict):
        raise ValueError(f"{RESOLVED} has no job")
    try:
        job = structure(body, JobSubmit)
    except SchemaError as exc:
        raise ValueError(f"{RESOLVED}: job: {exc}") from None
    if job.train is None or job.model is None:
        raise ValueError(f"{RESOLVED}: job is not a train job with a model")
    return job


def run_shape(resolved: dict[str, Any]) -> RunShape:
    """The predictor's view of a finished run, from its resolved config. The links are the
    network profile the runner held the run to (an experiment's ``network_profile``), else
    the job's own ``training.link``; ``training.network`` adds its link matrix."""
    job = resolved_job(resolved)
    training, model = job.train, job.model
    assert training is not None and model is not None  # (resolved_job refused the others)
    stages, replicas = job.topology.num_stages, job.topology.replicas
    problem = job_shape_error(model, training, stages, replicas, job.topology.layout)
    if problem is not None:
        raise ValueError(f"{RESOLVED}: {problem[1]}: {problem[0]}")
    profile = resolved.get("network_profile")
    if not isinstance(profile, dict) or not profile:
        profile = {} if training.link is None else {"name": "training.link",
                                                   **unstructure(training.link)}
    return RunShape(name=job.name, model=model, training=training, stages=stages,
                    replicas=replicas, network=network_for(profile, training.network, stages),
                    wiring=job.topology.wiring, route_weights=job.topology.route_weights,
                    routing=job.topology.routing, layout=job.topology.layout,
                    rebalance_every=job.topology.rebalance_every)


def slowed_cells(by_cell: Mapping[str, float] | None, shape: RunShape
                 ) -> tuple[tuple[int, int, float], ...]:
    """A run's emulated slowdowns (``MetricsSummary.emulated_slowdown_by_cell``: the largest
    each cell ran at, by its label "k" or "k.r") as the predictor takes them; cells the
    shape lacks, or labels that are not a cell's, left out."""
    out = []
    for label, x in (by_cell or {}).items():
        k, _, r = label.partition(".")
        if k.isdigit() and (r.isdigit() or not r) and x > 1.0 \
                and int(k) < shape.stages and int(r or 0) in shape.ids(int(k)):
            out.append((int(k), int(r or 0), float(x)))
    return tuple(sorted(out))


def predict_dir(run_dir: Path, label: str, measured: float | None, cache: Path | None = None,
                calibrate: bool = False, slowdowns: Mapping[str, float] | None = None
                ) -> RunPrediction:
    """One run's row (``slowdowns``: the run's emulated slowdowns by cell label, which the
    prediction plays as the run had them; the largest each cell ran at). Never raises for
    what the folder or the cache holds: a run the predictor cannot read says why in one
    line."""
    try:
        shape = run_shape(read_resolved(run_dir))
    except ValueError as exc:
        return RunPrediction(label, measured, why_not=f"cannot predict: {exc}")
    shape = attrs.evolve(shape, slowdowns=slowed_cells(slowdowns, shape))
    cache = cache or default_cache()
    if not calibrate and not cache.exists():
        # (saves importing torch, whose version keys the cache, only to find it empty)
        return RunPrediction(label, measured, why_not=NOT_CALIBRATED)
    try:
        done = predict_run(shape, cache, measure=None if calibrate else _refuse)
    except _NotInCache:
        return RunPrediction(label, measured, why_not=NOT_CALIBRATED)
    except ImportError as exc:
        return RunPrediction(label, measured, why_not=f"cannot predict: {exc}")
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        # (a hand-edited cache entry, a shape the traffic model or torch refuses)
        return RunPrediction(label, measured, why_not=f"cannot predict: {type(exc).__name__}: "
                                                      f"{exc}")
    return RunPrediction(label, measured, done.prediction,
                         moves=[(m.move.cells(), m.move.at, after.step_seconds)
                                for m, after in done.rebalance or ()])


HEADERS = ["run", "predicted s/step", "perfect overlap s/step", "measured s/step",
           "measured/pred", "bound by", "utilisation", "stage utilisation"]


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def rows(preds: list[RunPrediction]) -> list[list[str]]:
    """The section's table: a row per run with a prediction."""
    out = []
    for r in preds:
        p = r.prediction
        if p is None:
            continue
        stages = " ".join(f"s{s.stage} {s.utilisation:.0%}" for s in p.stages)
        out.append([r.label, f"{p.step_seconds:.3f}", f"{p.step_seconds_overlap:.3f}",
                    _f(r.measured, ".3f"), _f(r.ratio, ".2f"), p.bound_by,
                    f"{p.utilisation:.0%}", stages])
    return out


def html_section(preds: list[RunPrediction]) -> str:
    """The section: the table of predicted runs, then a line per run without a prediction."""
    table = ""
    if body := rows(preds):
        table = "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS) + \
            "</tr>" + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) +
                              "</tr>" for row in body) + "</table>"
    missing = "".join(f"<li>{html.escape(r.label)}: {html.escape(r.why_not)}</li>"
                      for r in preds if r.prediction is None and r.why_not)
    moved = "".join(f"<li>{html.escape(r.label)}: rebalancing, as its rule would move peers "
                    "on these speeds: " + "; ".join(
                        f"{html.escape(text)} before step {at} (then {step:.3f} s/step)"
                        for text, at, step in r.moves) + "</li>" for r in preds if r.moves)
    return ("<h2 id='predictor'>Predictor</h2><p>What <code>swarm predict</code> gives for "
            "each run's resolved config (its model, schedule, grid and links) from the stage "
            "times cached on this machine: the predicted step (the schedule played out, "
            "each frame queued on its sender's link and a latency a hop), the step a "
            "perfect overlap of compute and transfer would reach (a lower bound), what "
            "bounds it (compute, a link, or latency) and each stage's utilisation, beside "
            "the run's measured mean step (first step and evaluations left out).</p>"
            + table + (f"<ul class='moves'>{moved}</ul>" if moved else "")
            + (f"<ul class='why'>{missing}</ul>" if missing else ""))
