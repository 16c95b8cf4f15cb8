"""Headless actions of ``swarm`` / ``swarm-tui --cmd``. Nothing here imports Textual."""

from swarm_tui.commands import (
    cluster,
    daemons,
    fellows,
    jobs,
    launch,
    meta,
    models,
    predict,
    quickstart,
    suites,
    sweeps,
)

MODULES = (meta, daemons, cluster, fellows, jobs, sweeps, suites, models, predict, quickstart,
           launch)

__all__ = ["MODULES"]
