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


def test_a_cells_spec_reads_its_layout_from_its_start_as_a_fellow_receives_it():
    """What a fellow builds its stage from: the START's JSON. Under a layout every table of
    the spec is by id (an absent id reads None), the chain link down only where the next
    stage has the id, the ring through the stage's ids."""
    from swarm_core.pipeline.stage import StageSpec

    first = grid_starts()[0]
    layout = [[0, 1], [0, 1, 2, 3]]
    sent = on_layout(first, layout, 0, 1)
    got = structure(unstructure(sent), StageStart)
    spec = StageSpec.from_start(got)
    assert spec == StageSpec.from_start(sent)
    p = got.placement
    assert spec.layout == ((0, 1), (0, 1, 2, 3)) and spec.replicas == 3
    assert spec.group_addrs == (p.cell(0, 0).data_addr, p.cell(0, 1).data_addr, None, None)
    assert spec.down_addrs == tuple(p.cell(1, r).data_addr for r in range(4))
    assert spec.downstream_addr == p.cell(1, 1).data_addr
    assert spec.ring_next_addr == p.cell(0, 0).data_addr
    assert spec.cell_fellows == (p.cell(0, 0).fellow_id, p.cell(1, 0).fellow_id,
                                 p.cell(0, 1).fellow_id, p.cell(1, 1).fellow_id,
                                 None, p.cell(1, 2).fellow_id, None, p.cell(1, 3).fellow_id)
    lone = StageSpec.from_start(on_layout(first, layout, 1, 3))
    assert lone.downstream_addr is None and lone.down_addrs == ()
    assert lone.up_local == (False,) * 4 and lone.ring_next_addr == p.cell(1, 0).data_addr


def test_a_grids_spec_is_as_before():
    """A grid's tables are its replicas' (what every uniform job's links were built from)."""
    from swarm_core.pipeline.stage import StageSpec

    starts = grid_starts()
    for s in starts:
        spec = StageSpec.from_start(s)
        p, k = s.placement, s.stage
        assert spec.layout is None and spec.placement == p
        assert spec.group_addrs == tuple(c.data_addr for c in p.group(k))
        assert spec.down_addrs == (tuple(c.data_addr for c in p.group(k + 1))
                                   if k + 1 < 2 else ())
        assert spec.up_local == ((False,) * 3 if k > 0 else ())
        assert spec.cell_fellows == tuple(c.fellow_id for c in p.stages)
        assert spec.ring_next_addr == p.cell(k, (s.replica + 1) % 3).data_addr


def test_a_stayer_re_addressed_in_place_is_the_spec_of_its_moved_start():
    """At a move a cell that stays keeps its runner and spec: re-addressed in place, it is
    what the moved START would have built."""
    from swarm_core.pipeline.stage import StageSpec

    starts = grid_starts()
    for s in starts:
        if (s.stage, s.replica) == (0, 2):
            continue  # (the mover)
        spec = StageSpec.from_start(s)
        spec.placed(s.placement.moved(0, 2, 1, 3))
        assert spec == StageSpec.from_start(s.after_move(0, 2, 1, 3, at=3))
