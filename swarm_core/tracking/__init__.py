"""Experiment tracking: a run's figures in the tools researchers already compare runs with.

TensorBoard event files (``<run>/tb/``, through the ``tensorboard`` package's own writer) and,
optionally, MLflow (through ``mlflow-skinny``). Both are optional extras: nothing here imports
them until a sink is opened, and :class:`TrackingUnavailable` says which package is missing.
The sweep runner feeds a :class:`~swarm_core.tracking.run_log.RunLog` live while a run trains;
``swarm report --tensorboard`` feeds the same from a finished run's files.
"""

from __future__ import annotations

import importlib.util

import attrs

TRACKING_EXTRA = "pip install 'silentswarm[tracking]'"


class TrackingUnavailable(Exception):
    """A tracking package is not installed (one line: which, and how to get it)."""


class TrackingError(Exception):
    """A sink could not be opened or written (one line)."""


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


@attrs.frozen
class Tracking:
    """Where a sweep's runs are tracked: TensorBoard files beside each run's artifacts, and an
    MLflow tracking URI (None: no MLflow)."""

    tensorboard: bool = False
    mlflow_uri: str | None = None

    @classmethod
    def default(cls) -> Tracking:
        """What a run gets unasked: TensorBoard files when the package is there, else none."""
        return cls(tensorboard=tensorboard_installed())

    @property
    def enabled(self) -> bool:
        return self.tensorboard or self.mlflow_uri is not None
