"""What each replica of a stage sends its ring per step: the sync algorithm's own plan
(``GroupSync.planned_bytes``), asked of the algorithm built over the stage's real parameters
without links, and averaged over one period of its cadence (``SyncConfig.syncs_after``), as
the stage's own ``expected_sync_tx_bytes_per_step`` averages it over a run."""

from __future__ import annotations

from collections.abc import Sequence

from swarm_core.config.network import Placed
from swarm_core.predict.calibrate import StageWork, build_stage


def sync_bytes_per_step(works: Sequence[StageWork], replicas: int,
                        groups: Sequence[Sequence[int]] | None = None,
                        placed: Placed | None = None) -> list[float]:
    """Per stage, the bytes one ring member sends per step (empty without replicas; 0 for a
    stage of one cell). ``groups``: each stage's cell ids where they differ from the grid's
    (a layout's). Each ring in the format its cells code it in: ``sync.compression``, or
    fp32 where ``compress_when`` covers none of its links (``group_compresses``, the cells'
    sites by ``placed`` first)."""
    groups = [list(ids) for ids in groups] if groups is not None \
        else [list(range(replicas))] * len(works)
    if max(map(len, groups), default=1) < 2:
        return []
    import torch

    from swarm_core.pipeline.selective import group_codec
    from swarm_core.pipeline.syncs import make_sync

    out: list[float] = []
    for work, ids in zip(works, groups, strict=True):
        n = len(ids)
        if n < 2:
            out.append(0.0)
            continue
        module = build_stage(work)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        t = work.training
        sync = make_sync(t, [p for _, p in named], None, None, 0, n,
                         torch.device("cpu"), [name for name, _ in named],
                         group_codec(t, work.stage, ids, work.stages, placed))
        try:
            # One period of the cadence; a run's last step and checkpoints aside.
            cycle = t.sync.inner_steps if t.sync.periodic else 1
            sent = sum(sync.planned_bytes(i, False, False) for i in range(cycle)
                       if t.sync.syncs_after(i + 1, 0))
        finally:
            sync.close()
        out.append(sent / cycle)
    return out
