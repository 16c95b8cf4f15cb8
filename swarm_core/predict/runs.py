"""The runs a config file describes, as the predictor needs them: an experiment (every run of
its sweep, by the loader ``swarm validate`` uses) or one job body (as ``swarm submit`` sends)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarm_core.config.profiles import ConfigError, load_experiment
from swarm_core.config.schemas import ModelConfig, TrainingConfig, job_shape_error
from swarm_core.contract import JobSubmit
from swarm_core.predict.network import network_for
from swarm_core.predict.step import RunShape
from swarm_core.schema import SchemaError, structure, unstructure


class PredictInputError(ValueError):
    """A config the predictor cannot read: one line naming the file and what is wrong."""


def load_runs(path: str | Path) -> list[RunShape]:
    """Every run ``path`` describes. Raises PredictInputError."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise PredictInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PredictInputError(f"{path}: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PredictInputError(f"{path}: expected a JSON object (an experiment config or a "
                                "job body)")
    if "topology" in raw or raw.get("kind") == "train":
        return [_job_run(path, raw)]
    try:
        exp = load_experiment(path)
    except ConfigError as exc:
        raise PredictInputError(str(exc)) from None
    shapes = []
    for r in exp.runs:
        training = structure(r.training, TrainingConfig)
        shapes.append(RunShape(name=r.run_name, model=structure(r.model, ModelConfig),
                               training=training, stages=r.stages, replicas=r.replicas,
                               network=network_for(r.network, training.network, r.stages),
                               wiring=r.wiring.get("wiring", "chain"),
                               route_weights=r.wiring.get("route_weights"),
                               routing=r.wiring.get("routing", "given"),
                               layout=r.wiring.get("layout")))
    return shapes


def _job_run(path: Path, raw: dict[str, Any]) -> RunShape:
    try:
        job = structure(raw, JobSubmit)
    except SchemaError as exc:
        raise PredictInputError(f"{path}: {exc}") from None
    training = job.train
    if training is None or job.model is None:
        raise PredictInputError(f"{path}: kind: a train job has a model to predict, got "
                                f"{job.kind!r}")
    problem = job_shape_error(job.model, training, job.topology.num_stages,
                              job.topology.replicas, job.topology.layout)
    if problem is not None:
        raise PredictInputError(f"{path}: {problem[1]}: {problem[0]}")
    link = training.link
    network = network_for({} if link is None else {"name": "training.link",
                                                    **unstructure(link)},
                          training.network, job.topology.num_stages)
    return RunShape(name=job.name, model=job.model, training=training,
                    stages=job.topology.num_stages, replicas=job.topology.replicas,
                    network=network, wiring=job.topology.wiring,
                    route_weights=job.topology.route_weights, routing=job.topology.routing,
                    layout=job.topology.layout, rebalance_every=job.topology.rebalance_every)


def profile_run(model_path: str | None, training_path: str | None,
                stages: int | None = None, replicas: int | None = None) -> RunShape:
    """A run as ``swarm submit --model/--training`` would queue it (defaults for what is not
    given; the grid from the training profile's cluster, then ``stages``/``replicas``)."""
    from swarm_core.config.defaults import DEFAULT_MODEL, DEFAULT_TRAINING
    from swarm_core.config.profiles import (
        job_topology,
        load_job_cluster,
        load_job_training,
        load_model_profile,
    )

    try:
        model = unstructure(load_model_profile(Path(model_path))) if model_path \
            else dict(DEFAULT_MODEL)
        training, fellows = load_job_training(Path(training_path)) if training_path \
            else (dict(DEFAULT_TRAINING), None)
        cluster = load_job_cluster(Path(training_path)) if training_path else None
    except ConfigError as exc:
        raise PredictInputError(str(exc)) from None
    topology = job_topology(cluster, fellows if stages is None else None, stages, replicas)
    name = Path(model_path).stem if model_path else "job"
    return _job_run(Path(training_path or model_path or "(defaults)"),
                    {"name": name, "kind": "train", "model": model, "training": training,
                     "topology": topology})
