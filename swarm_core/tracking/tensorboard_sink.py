"""TensorBoard event files of one run, written with the ``tensorboard`` package's own writer
(its ``EventFileWriter`` and summary protos; no TensorFlow, no torch).

Scalars are written as float64 tensors with the scalar plugin's metadata rather than the
legacy float32 ``simple_value``: a run's wire bytes per step reach millions, which float32
rounds, and the files should hold the numbers ``train_progress.ndjson`` holds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from swarm_core.tracking import TRACKING_EXTRA, TrackingError, TrackingUnavailable

FLUSH_S = 2.0  # the writer's own background flush; the runner also flushes after each poll


def _modules() -> dict[str, Any]:
    try:
        import numpy as np
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.hparams import summary_v2 as hparams_summary
        from tensorboard.plugins.scalar import metadata as scalar_metadata
        from tensorboard.plugins.text import summary_v2 as text_summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        from tensorboard.util import tensor_util
    except ImportError:
        raise TrackingUnavailable("TensorBoard files need the tensorboard package: "
                                  f"{TRACKING_EXTRA}") from None
    return {"np": np, "event_pb2": event_pb2, "summary_pb2": summary_pb2,
            "hparams": hparams_summary, "scalar_metadata": scalar_metadata, "text": text_summary,
            "writer": EventFileWriter, "tensor_util": tensor_util}


class TensorBoardSink:
    """One run's event file under ``logdir`` (a run directory's ``tb/``)."""

    def __init__(self, logdir: Path) -> None:
        self._m = _modules()
        try:
            logdir.mkdir(parents=True, exist_ok=True)
            self._writer = self._m["writer"](str(logdir), flush_secs=FLUSH_S)
        except OSError as exc:
            raise TrackingError(f"cannot write TensorBoard files in {logdir}: "
                                f"{exc.strerror or exc}") from None
        self.logdir = logdir
        # TensorBoard takes the first SessionLog START as the session's beginning and each
        # later one as a restart that voids the steps from its own on (see purge).
        self._session_start(0)
        self._scalar_meta = self._m["scalar_metadata"].create_summary_metadata(
            display_name=None, description=None)

    def _event(self, step: int, wall_time: float | None, summary: Any) -> None:
        self._writer.add_event(self._m["event_pb2"].Event(
            step=step, wall_time=wall_time or time.time(), summary=summary))

    def hparams(self, run_id: str, params: dict[str, bool | int | float | str],
                start_time: float | None) -> None:
        summary = self._m["hparams"].hparams_pb(params, trial_id=run_id,
                                                start_time_secs=start_time)
        self._event(0, start_time, summary)

    def scalars(self, step: int, values: list[tuple[str, float]],
                wall_time: float | None) -> None:
        make = self._m["tensor_util"].make_tensor_proto
        np = self._m["np"]
        summary = self._m["summary_pb2"].Summary()
        for tag, v in values:
            summary.value.add(tag=tag, metadata=self._scalar_meta,
                              tensor=make(np.float64(v)))
        self._event(step, wall_time, summary)

    def text(self, tag: str, step: int, text: str, wall_time: float | None) -> None:
        self._event(step, wall_time, self._m["text"].text_pb(tag, text))

    def purge(self, from_step: int) -> None:
        """Steps from ``from_step`` on are void (the run resumed from before them): TensorBoard
        drops what it read of them when it meets a SessionLog START at that step, the way
        torch's SummaryWriter(purge_step=...) asks it to."""
        self._session_start(from_step)

    def _session_start(self, step: int) -> None:
        pb = self._m["event_pb2"]
        self._writer.add_event(pb.Event(step=step, wall_time=time.time(),
                                        session_log=pb.SessionLog(status=pb.SessionLog.START)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self, status: str) -> None:  # (TensorBoard keeps no run status)
        self._writer.close()
