"""One run's tracking, fed step by step: what every sink has been given so far.

The runner feeds it while the run trains (only steps that are settled; see :func:`settled`)
and once more when the run ends; :func:`convert_run` feeds it a finished run's files. Either
way the sinks get the lines ``train_progress.ndjson`` holds, so the two always agree.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from swarm_core import jsonio
from swarm_core.contract import ProgressRecord
from swarm_core.tracking import Tracking, TrackingError
from swarm_core.tracking.names import (
    MEMBERSHIP_TAG,
    SET_SPEED_TAG,
    hparams,
    link_change_text,
    restart_text,
    step_scalars,
)

TB_DIR = "tb"  # a run directory's TensorBoard folder


class Sink(Protocol):
    def hparams(self, run_id: str, params: dict[str, bool | int | float | str],
                start_time: float | None) -> None: ...
    def scalars(self, step: int, values: list[tuple[str, float]],
                wall_time: float | None) -> None: ...
    def text(self, tag: str, step: int, text: str, wall_time: float | None) -> None: ...
    def purge(self, from_step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self, status: str) -> None: ...


def open_sinks(tracking: Tracking, tb_dir: Path, experiment: str, run_id: str) -> list[Sink]:
    """The sinks ``tracking`` asks for (TrackingUnavailable, TrackingError: one line)."""
    sinks: list[Sink] = []
    try:
        if tracking.tensorboard:
            from swarm_core.tracking.tensorboard_sink import TensorBoardSink

            sinks.append(TensorBoardSink(tb_dir))
        if tracking.mlflow_uri is not None:
            from swarm_core.tracking.mlflow_sink import MlflowSink

            sinks.append(MlflowSink(tracking.mlflow_uri, experiment, run_id,
                                    tags={"silentswarm.run_id": run_id}))
    except BaseException:
        for s in sinks:
            s.close("FAILED")
        raise
    return sinks


def settled(records: list[ProgressRecord], cells: int) -> list[ProgressRecord]:
    """The records of a running job that will not change: every cell has reported the step,
    and so has every cell the next step (a step's evaluation is reported after the step
    itself, before the next one, so the newest complete step may still gain its eval loss).
    Only the complete run of steps from the first: a step still missing a cell holds back
    the steps after it, since the sinks are given steps in order, once."""
    done: list[ProgressRecord] = []
    for r in records:
        if len(r.stages_reported) < cells:
            break
        done.append(r)
    return done[:-1]


class RunLog:
    def __init__(self, run_id: str, sinks: list[Sink]) -> None:
        self.run_id = run_id
        self.sinks = sinks
        self.step = 0  # the newest step given to the sinks
        self._changes: set[tuple[Any, ...]] = set()
        self._restarts: set[tuple[Any, ...]] = set()

    def _each(self, method: str, *args: Any) -> None:
        for sink in self.sinks:
            getattr(sink, method)(*args)

    def begin(self, resolved: dict[str, Any], start_time: float | None) -> None:
        """The run's resolved config (``config_resolved.json``) as its hyperparameters."""
        self._each("hparams", self.run_id, hparams(resolved), start_time)

    def restarts(self, restarts: list[dict[str, Any]]) -> None:
        """Recoveries not yet seen: a membership event each; steps the run trains again are
        purged first, so they are not shown twice."""
        for r in restarts:
            key = (r.get("at"), r.get("at_step"), r.get("resume_step"))
            if key in self._restarts:
                continue
            self._restarts.add(key)
            text = restart_text(r)
            if text is None:
                continue
            resume = int(r["resume_step"])
            if resume < self.step:
                self._each("purge", resume + 1)
                self.step = resume
            self._each("text", MEMBERSHIP_TAG, resume, text, _float(r.get("at")))

    def link_changes(self, changes: list[dict[str, Any]]) -> None:
        for c in changes:
            key = (c.get("at"), c.get("fellow_id"), c.get("at_step"))
            if key in self._changes:
                continue
            self._changes.add(key)
            text = link_change_text(c)
            if text is not None:
                step = c.get("at_step") if isinstance(c.get("at_step"), int) else 0
                self._each("text", SET_SPEED_TAG, step, text, _float(c.get("at")))

    def progress(self, lines: list[dict[str, Any]]) -> None:
        """Progress lines (as ``train_progress.ndjson`` holds them) after the newest given."""
        for line in lines:
            step = line.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or step <= self.step:
                continue
            values = step_scalars(line)
            if values:
                self._each("scalars", step, values, _float(line.get("ts")))
            self.step = step

    def flush(self) -> None:
        self._each("flush")

    def close(self, status: str) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close(status)
            except TrackingError as exc:
                errors.append(exc)
        self.sinks = []
        if errors:
            raise errors[0]


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _read_json(path: Path) -> Any:
    try:
        return jsonio.loads(path.read_bytes())
    except (OSError, jsonio.JSONDecodeError):
        return None


def convert_run(run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any],
                tracking: Tracking, tb_root: Path | None) -> Path | None:
    """A finished run's files into the sinks ``tracking`` names: TensorBoard files under
    ``tb_root/<run>/`` (written beside, then swapped in whole, so a reader never sees a
    half-converted run), MLflow as a new run. Returns the TensorBoard folder."""
    resolved = _read_json(run_dir / "config_resolved.json")
    resolved = resolved if isinstance(resolved, dict) else {}
    manifest = _read_json(run_dir / "manifest.json")
    manifest = manifest if isinstance(manifest, dict) else {}
    run_id = str(resolved.get("run_id") or summary.get("run_id") or run_dir.name)
    experiment = str(resolved.get("experiment") or manifest.get("experiment") or "silentswarm")
    status = str(manifest.get("status") or summary.get("status") or "COMPLETED")
    final = tb_root / run_dir.name if tb_root is not None else None
    partial = tb_root / f".{run_dir.name}.partial" if tb_root is not None else None
    if partial is not None:
        shutil.rmtree(partial, ignore_errors=True)
    sinks = open_sinks(Tracking(tensorboard=tb_root is not None,
                                mlflow_uri=tracking.mlflow_uri),
                       partial or run_dir / TB_DIR, experiment, run_id)
    log = RunLog(run_id, sinks)
    try:
        try:
            first_ts = next((r["ts"] for r in records
                             if isinstance(r.get("ts"), int | float)), None)
            log.begin(resolved, first_ts or time.time())
            log.restarts([r for r in summary.get("restarts") or [] if isinstance(r, dict)])
            log.link_changes([c for c in summary.get("link_changes") or []
                              if isinstance(c, dict)])
            log.progress(records)
        finally:
            log.close(status)
    except BaseException:
        if partial is not None:  # (nothing half-written is left behind)
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if final is not None and partial is not None:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    return final
