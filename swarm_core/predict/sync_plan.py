"""What each replica of a stage sends its ring per step: the sync algorithm's own plan
(``GroupSync.planned_bytes``), asked of the algorithm built over the stage's real parameters
without links, and averaged over one period of its cadence (``SyncConfig.syncs_after``), as
the stage's own ``expected_sync_tx_bytes_per_step`` averages it over a run."""

from __future__ import annotations

from collections.abc import Sequence

from swarm_core.predict.calibrate import StageWork, build_stage


def sync_bytes_per_step(works: Sequence[StageWork], replicas: int,
                        sizes: Sequence[int] | None = None) -> list[float]:
    """Per stage, the bytes one ring member sends per step (empty without replicas; 0 for a
    stage of one cell). ``sizes``: each stage's ring size where they differ (a layout's)."""
    sizes = list(sizes) if sizes is not None else [replicas] * len(works)
    if max(sizes, default=1) < 2:
        return []
    import torch

    from swarm_core.pipeline.syncs import make_sync

    out: list[float] = []
    for work, n in zip(works, sizes, strict=True):
        if n < 2:
            out.append(0.0)
            continue
        module = build_stage(work)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        t = work.training
        sync = make_sync(t, [p for _, p in named], None, None, 0, n,
                         torch.device("cpu"), [n for n, _ in named])
        try:
            # One period of the cadence; a run's last step and checkpoints aside.
            cycle = t.sync.inner_steps if t.sync.periodic else 1
            sent = sum(sync.planned_bytes(i, False, False) for i in range(cycle)
                       if t.sync.syncs_after(i + 1, 0))
        finally:
            sync.close()
        out.append(sent / cycle)
    return out
