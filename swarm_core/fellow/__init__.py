"""The fellow daemon: registers with the leader, heartbeats, obeys signals, runs its stage."""

from swarm_core.fellow.daemon import FellowDaemon, FellowOptions

__all__ = ["FellowDaemon", "FellowOptions"]
