"""A START under a swarm layout (docs/placement-cells.md, step 2): a cell is (stage, id) of
its placement's layout, its ring runs through its stage's ids, and a move gives the moving
peer its new cell's START in band. A grid's START answers as it did."""

from __future__ import annotations

import attrs
import pytest

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract import chain_starts
from swarm_core.contract.placement import FellowSlots, plan
from swarm_core.contract.start import StageStart
from swarm_core.schema import FieldError, structure, unstructure

ADDRS = [f"127.0.0.1:{9100 + i}" for i in range(6)]


def grid_starts(stages: int = 2, replicas: int = 3) -> list[StageStart]:
    model = structure({"n_layers": 4, "d_model": 16, "n_heads": 2}, ModelConfig)
    training = structure({"steps": 9, "batch_size": 12, "micro_batches": 2}, TrainingConfig)
    return chain_starts(model, training, ADDRS[:stages * replicas], replicas=replicas,
                        wiring="swarm")


def on_layout(start: StageStart, layout: list[list[int]], stage: int, cell: int
              ) -> StageStart:
    n = sum(len(ids) for ids in layout)
    fellows = [FellowSlots(i, f"fellow-{i}", ["cpu"], ADDRS[i]) for i in range(n)]
    p = plan(fellows, len(layout), 4, replicas=start.replicas, layout=layout)
    return attrs.evolve(start, placement=p, stage=stage, replica=cell)


def test_grid_rings_are_as_before():
    for s in grid_starts():
        r = s.replica
        assert s.ring_next is s.placement.cell(s.stage, (r + 1) % 3)
        assert not s.local_ring


def test_a_cell_rings_through_its_stages_ids():
    first = grid_starts()[0]
    s = on_layout(first, [[0, 1], [0, 1, 2, 3]], 1, 3)
    assert s.ring_next is s.placement.cell(1, 0)  # (3 is the last id: round to 0)
    assert s.downstream_addr is None and s.replicas == 3
    alone = on_layout(first, [[0], [0, 1, 2]], 0, 0)
    assert alone.ring_next is None and not alone.local_ring  # a stage of one cell


def test_a_cell_not_in_the_layout_is_refused_in_one_line():
    with pytest.raises(FieldError, match=r"no cell 0\.2 in the placement's layout "
                                         r"\[\[0, 1\], \[0, 1, 2, 3\]\]") as err:
        on_layout(grid_starts()[0], [[0, 1], [0, 1, 2, 3]], 0, 2)
    assert "\n" not in str(err.value)


def test_after_a_move_the_mover_runs_its_new_cell():
    starts = grid_starts()  # S=2 x R=3; stage 0's cell 2 moves to stage 1 as cell 3 at 3
    mover = next(s for s in starts if (s.stage, s.replica) == (0, 2))
    new = mover.after_move(0, 2, 1, 3, at=3)
    assert (new.stage, new.replica, new.resume_step) == (1, 3, 3)
    assert new.mine.data_addr == mover.mine.data_addr  # its listener stays
    assert new.mine.layers == mover.placement.cell(1, 0).layers
    assert new.key == mover.key and new.attempt == mover.attempt
    stayer = next(s for s in starts if (s.stage, s.replica) == (1, 0))
    after = stayer.after_move(0, 2, 1, 3, at=3)
    assert (after.stage, after.replica, after.resume_step) == (1, 0, 0)
    assert after.placement == new.placement  # every cell reaches the same placement
    assert [c.replica for c in after.placement.group(1)] == [0, 1, 2, 3]
    assert structure(unstructure(new), StageStart) == new  # what a leader would send
