"""One run in MLflow, through ``mlflow-skinny``'s client: the same figures as the TensorBoard
files (metrics by step), the resolved config as params, the run's events as ``events.txt``."""

from __future__ import annotations

import os
from typing import Any

from swarm_core.tracking import TrackingError, TrackingUnavailable

MLFLOW_EXTRA = "pip install mlflow-skinny"
PARAM_MAX = 6000  # MLflow refuses longer param values
PARAMS_PER_BATCH = 100  # and more params or metrics than these in one log_batch
METRICS_PER_BATCH = 1000
STATUS = {"COMPLETED": "FINISHED", "CANCELLED": "KILLED"}  # anything else: FAILED


def _modules() -> dict[str, Any]:
    try:
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise TrackingUnavailable(f"--mlflow-uri needs MLflow: {MLFLOW_EXTRA}") from None
    return {"client": MlflowClient, "Metric": Metric, "Param": Param, "error": MlflowException}


def _allow_file_store(uri: str) -> None:
    """MLflow 3 refuses a plain folder store unless MLFLOW_ALLOW_FILE_STORE is set; a user who
    names ``file:./mlruns`` asked for exactly that store."""
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


class MlflowSink:
    """One MLflow run (named as the SilentSwarm run) in the experiment named as the sweep."""

    def __init__(self, uri: str, experiment: str, run_name: str,
                 tags: dict[str, str] | None = None) -> None:
        self._m = _modules()
        _allow_file_store(uri)
        self.uri = uri
        self.events: list[str] = []
        try:
            self.client = self._m["client"](tracking_uri=uri)
            found = self.client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found is not None else \
                self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run_name,
                                                 tags=tags or {}).info.run_id
        except (self._m["error"], OSError) as exc:
            raise TrackingError(f"MLflow at {uri}: {_first_line(exc)}") from None

    def _call(self, fn: Any, *args: Any, **kw: Any) -> None:
        try:
            fn(*args, **kw)
        except (self._m["error"], OSError) as exc:
            raise TrackingError(f"MLflow at {self.uri}: {_first_line(exc)}") from None

    def hparams(self, run_id: str, params: dict[str, bool | int | float | str],
                start_time: float | None) -> None:
        items = [self._m["Param"](k, str(v)[:PARAM_MAX]) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self._call(self.client.log_batch, self.run_id,
                       params=items[i:i + PARAMS_PER_BATCH])

    def scalars(self, step: int, values: list[tuple[str, float]],
                wall_time: float | None) -> None:
        ms = int((wall_time or 0.0) * 1000)
        metrics = [self._m["Metric"](tag, v, ms, step) for tag, v in values]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self._call(self.client.log_batch, self.run_id,
                       metrics=metrics[i:i + METRICS_PER_BATCH])

    def text(self, tag: str, step: int, text: str, wall_time: float | None) -> None:
        self.events.append(f"step {step} {tag}: {text}")

    def purge(self, from_step: int) -> None:
        # MLflow cannot take metrics back: the resumed steps are logged again after these.
        self.events.append(f"step {from_step}: steps from here were trained again "
                           "(the run resumed); their metrics were logged twice")

    def flush(self) -> None:
        pass  # (every call above is already stored)

    def close(self, status: str) -> None:
        if self.events:
            self._call(self.client.log_text, self.run_id, "\n".join(self.events) + "\n",
                       "events.txt")
        self._call(self.client.set_terminated, self.run_id, STATUS.get(status, "FAILED"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
