"""Headless actions of ``swarm`` / ``swarm-tui --cmd``. Nothing here imports Textual."""

from swarm_tui.commands import cluster, daemons, fellows, jobs, meta, quickstart

MODULES = (meta, daemons, cluster, fellows, jobs, quickstart)

__all__ = ["MODULES"]
