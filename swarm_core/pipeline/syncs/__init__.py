"""How a stage group's replicas stay one model: one algorithm per file, each a
:class:`GroupSync`, found by its public name (``sync.mode``) in ``config.methods.SYNC_METHODS``.

The stage runs every algorithm alike: ``arm`` before the step's last backward,
``after_backward`` before the optimiser step, ``collect`` and ``after_step`` after it. The
group's membership (who is in the ring, regrouping when it breaks) is the ReplicaGroup's; an
algorithm is handed its ring's links and rewired when they change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm_core.config.methods import SYNC_METHODS, load
from swarm_core.config.schemas import TrainingConfig
from swarm_core.pipeline.codecs import WireCodec
from swarm_core.pipeline.syncs.base import GroupSync, Synced
from swarm_core.pipeline.transport import PeerLink

__all__ = ["GroupSync", "Synced", "make_sync"]


def make_sync(training: TrainingConfig, params: Sequence[torch.nn.Parameter],
              send: PeerLink | None, recv: PeerLink | None, rank: int, replicas: int,
              device: torch.device, names: Sequence[str] = (),
              codec: WireCodec | None = None) -> GroupSync:
    """The algorithm ``training.sync.mode`` names, over the group's ring (``send`` to the
    next member, ``recv`` from the one before), coding what crosses by ``codec``, else
    ``training.sync.compression`` (``compress_when`` may leave a group out: see
    ``pipeline/selective.sync_codec``). ``names``: the parameters' (``blocks.N.…``), where an
    algorithm groups them by layer (Streaming DiLoCo's fragments)."""
    method = SYNC_METHODS[training.sync.mode]
    codec = WireCodec.of_sync(training.sync) if codec is None else codec
    sync: GroupSync = load(method.impl)(training, params, send, recv, rank, replicas, codec,
                                        device, names)
    return sync
