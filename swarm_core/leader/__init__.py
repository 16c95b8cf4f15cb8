"""The leader: fellow registry, job queue and dispatcher, event stream, SQLite state.

Runs on a login node, so nothing under this package may import torch (a test checks it).
"""

from swarm_core.leader.app import LeaderConfig, create_app, run_leader

__all__ = ["LeaderConfig", "create_app", "run_leader"]
