"""The leader: fellow registry, job queue and dispatcher, event stream, SQLite state.

Runs on a login node, so nothing under this package may import torch (a test checks it). Code
outside this package uses only the names exported here; everything else goes through HTTP and
:mod:`swarm_core.client`.
"""

from swarm_core.leader.app import LeaderConfig, StateDirBusy, create_app, run_leader
from swarm_core.leader.auth import TokenFileError, read_token
from swarm_core.leader.store import StoreError

__all__ = ["LeaderConfig", "StateDirBusy", "StoreError", "TokenFileError", "create_app",
           "read_token", "run_leader"]
