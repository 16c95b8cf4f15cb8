"""Headless actions of ``swarm`` / ``swarm-tui --cmd``. Nothing here imports Textual."""

from swarm_tui.commands import (
    cluster,
    daemons,
    fellows,
    jobs,
    meta,
    models,
    quickstart,
    suites,
    sweeps,
)

MODULES = (meta, daemons, cluster, fellows, jobs, sweeps, suites, models, quickstart)

__all__ = ["MODULES"]
