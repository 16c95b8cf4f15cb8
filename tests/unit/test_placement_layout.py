"""A placement that holds a swarm layout (docs/placement-cells.md, step 1): stages of unequal
cells, listed id by id; a uniform job's placement, JSON and answers exactly as before."""

from __future__ import annotations

import json

import pytest

from swarm_core.contract.placement import (
    FellowSlots,
    Placement,
    PlacementError,
    layout_cells,
    normal_layout,
    plan,
)
from swarm_core.schema import structure, unstructure


def fellows(n: int, slots: int = 1) -> list[FellowSlots]:
    return [FellowSlots(i, f"f{i}", ["cpu"] * slots, f"127.0.0.1:{9000 + i}")
            for i in range(n)]


# plan(fellows(4), 2, 12, replicas=2) as unstructured before layouts existed, key for key.
GRID_2x2 = (
    '{"num_stages": 2, "n_layers": 12, "stages": ['
    '{"stage": 0, "fellow_id": 0, "name": "f0", "slot": 0, "device": "cpu", "layers": '
    '{"start": 0, "stop": 6}, "data_addr": "127.0.0.1:9000", "replica": 0}, '
    '{"stage": 1, "fellow_id": 1, "name": "f1", "slot": 0, "device": "cpu", "layers": '
    '{"start": 6, "stop": 12}, "data_addr": "127.0.0.1:9001", "replica": 0}, '
    '{"stage": 0, "fellow_id": 2, "name": "f2", "slot": 0, "device": "cpu", "layers": '
    '{"start": 0, "stop": 6}, "data_addr": "127.0.0.1:9002", "replica": 1}, '
    '{"stage": 1, "fellow_id": 3, "name": "f3", "slot": 0, "device": "cpu", "layers": '
    '{"start": 6, "stop": 12}, "data_addr": "127.0.0.1:9003", "replica": 1}], '
    '"replicas": 2}')


def test_uniform_json_is_unchanged_and_round_trips():
    p = plan(fellows(4), 2, 12, replicas=2)
    assert json.dumps(unstructure(p)) == GRID_2x2
    assert structure(json.loads(GRID_2x2), Placement) == p


def test_a_uniform_layout_is_the_grid():
    grid = plan(fellows(4), 2, 12, replicas=2)
    given = plan(fellows(4), 2, 12, replicas=2, layout=[[1, 0], [0, 1]])
    assert given == grid and given.layout is None
    assert json.dumps(unstructure(given)) == GRID_2x2


@pytest.mark.parametrize(("stages", "replicas", "slots"), [(1, 1, 1), (3, 1, 1), (2, 3, 1),
                                                           (4, 2, 2), (3, 2, 1)])
def test_uniform_answers_are_the_grid_arithmetic(stages, replicas, slots):
    p = plan(fellows(stages * replicas, slots), stages, 12, replicas=replicas)
    assert p.width == replicas
    for k in range(stages):
        assert p.ids(k) == list(range(replicas))
        assert [c.replica for c in p.group(k)] == list(range(replicas))
        for r in range(replicas):
            i = r * stages + k
            assert p.index(k, r) == i and p.cell(k, r) is p.stages[i]
            assert p.has(k, r) and p.holds(p.stages[i].fellow_id, k, r)
            assert p.label(k, r) == (str(k) if replicas == 1 else f"{k}.{r}")
            assert p.downstream(k, r) is (p.stages[i + 1] if k + 1 < stages else None)
            assert p.upstream(k, r) is (p.stages[i - 1] if k > 0 else None)


# S=2, R=2: stage 0 runs ids 0 and 1, stage 1 has an extra cell, id 2 (issue 34's layouts).
LAYOUT = [[0, 1], [0, 1, 2]]


def test_layout_cells_go_id_by_id():
    assert layout_cells(((0, 1), (0, 1, 2))) == [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2)]
    assert layout_cells(((0,), (0, 2))) == [(0, 0), (1, 0), (1, 2)]


def test_plan_of_a_layout():
    p = plan(fellows(5), 2, 12, replicas=2, layout=LAYOUT)
    assert p.layout == ((0, 1), (0, 1, 2)) and p.width == 3 and p.replicas == 2
    assert [(c.stage, c.replica, c.fellow_id) for c in p.stages] == \
        [(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3), (1, 2, 4)]
    assert p.cell(1, 2).layers.as_tuple() == (6, 12)  # its stage's layers
    assert p.ids(0) == [0, 1] and p.ids(1) == [0, 1, 2]
    assert [c.fellow_id for c in p.group(1)] == [1, 3, 4]
    assert p.group_of(1, 2) == (("127.0.0.1:9001", "127.0.0.1:9003", "127.0.0.1:9004"),
                                (False, False, True))


def test_a_layout_names_and_links_by_id():
    p = plan(fellows(3), 2, 12, replicas=1, layout=[[0], [0, 1]])  # one share, 1+2 cells
    assert p.label(0, 0) == "0.0" and p.label(1, 1) == "1.1"  # always the id: 2 cells at 1
    assert p.index(1, 1) == 2 and p.has(1, 1) and not p.has(0, 1)
    assert p.downstream(0, 0) is p.cell(1, 0)
    assert p.upstream(1, 1) is None  # id 1 has no cell at stage 0: route links only
    assert p.holds(2, 1, 1) and not p.holds(2, 0, 1) and not p.holds(1, 1, 1)
    assert p.replicas_held(2, 1) == [1] and p.replicas_held(2, 0) == []
    with pytest.raises(PlacementError, match=r"^no cell 0\.1 in layout \[\[0\], \[0, 1\]\]$"):
        p.index(0, 1)


def test_a_layout_round_trips_through_json():
    p = plan(fellows(5), 2, 12, replicas=2, layout=LAYOUT)
    d = json.loads(json.dumps(unstructure(p)))
    assert d["layout"] == LAYOUT
    assert structure(d, Placement) == p


@pytest.mark.parametrize(("layout", "why"), [
    ([[0, 1]], "1 stages listed for a 2-stage job"),
    ([[0], []], "stage 1 has no cells"),
    ([[0], [1, 2]], "stage 1 has no cell 0"),
    ([[0, 0], [0]], r"stage 0's ids \[0, 0\] repeat"),
])
def test_bad_layouts_are_refused_in_one_line(layout, why):
    with pytest.raises(PlacementError, match=why) as err:
        normal_layout(layout, 2, 2)
    assert "\n" not in str(err.value)


def test_too_few_slots_for_a_layout():
    with pytest.raises(PlacementError, match=r"^2 stages of cells 2\+3 need 5 device slots, "
                                             r"the fellows offer 4$"):
        plan(fellows(4), 2, 12, replicas=2, layout=LAYOUT)


def test_cells_out_of_the_layout_order_are_refused():
    p = plan(fellows(5), 2, 12, replicas=2, layout=LAYOUT)
    with pytest.raises(PlacementError, match="must list its cells id by id"):
        Placement(2, 12, list(reversed(p.stages)), 2, p.layout)


def test_a_move_gives_the_peer_its_new_cell():
    # S=2 x R=3 uniform; stage 0's cell 2 moves to stage 1 as cell 3 (the rebalancing test's).
    p = plan(fellows(6), 2, 12, replicas=3)
    q = p.moved(0, 2, 1, 3)
    assert q.layout == ((0, 1), (0, 1, 2, 3))
    mover = p.cell(0, 2)
    now = q.cell(1, 3)
    assert (now.fellow_id, now.slot, now.device, now.data_addr) == \
        (mover.fellow_id, mover.slot, mover.device, mover.data_addr)
    assert now.layers == p.cell(1, 0).layers and now.label == "1.3"
    assert not q.has(0, 2) and q.holds(mover.fellow_id, 1, 3)
    assert [c.fellow_id for c in q.group(1)] == [1, 3, 5, 4]
    assert structure(json.loads(json.dumps(unstructure(q))), Placement) == q


def test_a_move_back_to_the_grid_is_the_grid():
    p = plan(fellows(4), 2, 12, replicas=2, layout=[[0], [0, 1, 2]])
    q = p.moved(1, 2, 0, 1)  # fellow 3 (stage 1's cell 2) takes the grid's cell 0.1
    assert q.layout is None and "layout" not in unstructure(q)
    assert [(c.stage, c.replica, c.fellow_id) for c in q.stages] == \
        [(0, 0, 0), (1, 0, 1), (0, 1, 3), (1, 1, 2)]
    assert q.cell(0, 1).layers.as_tuple() == (0, 6)


@pytest.mark.parametrize(("move", "why"), [
    ((0, 5, 1, 3), r"^move: no cell 0\.5 to move$"),
    ((0, 1, 0, 3), "^move: stage 0 is not another stage of the job$"),
    ((0, 1, 1, 1), "^move: stage 1 already has a cell 1$"),
    ((0, 0, 1, 3), "^layout: stage 0 has no cell 0"),
])
def test_moves_that_do_not_fit_are_refused_in_one_line(move, why):
    with pytest.raises(PlacementError, match=why):
        plan(fellows(4), 2, 12, replicas=2).moved(*move)


def test_cells_that_leave_take_nothing_else_with_them():
    # S=2 x R=3 uniform; stage 1's cell 2 leaves (a swarm job's cell-wise departure).
    p = plan(fellows(6), 2, 12, replicas=3)
    q = p.without([(1, 2)])
    assert q.layout == ((0, 1, 2), (0, 1)) and q.replicas == 3
    assert [(c.stage, c.replica, c.fellow_id) for c in q.stages] == \
        [(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3), (0, 2, 4)]
    assert q.cell(0, 2) == p.cell(0, 2)  # (every other cell where it was)
    assert structure(json.loads(json.dumps(unstructure(q))), Placement) == q
    # (a layout's extra cell leaving may bring the grid back)
    r = plan(fellows(5), 2, 12, replicas=2, layout=[[0, 1], [0, 1, 2]]).without([(1, 2)])
    assert r.layout is None and len(r.stages) == 4


@pytest.mark.parametrize(("cells", "why"), [
    ([(1, 0)], "^layout: stage 1 has no cell 0"),
    ([(0, 5)], r"^no cell 0\.5 to leave$"),
])
def test_cells_that_cannot_leave_are_refused_in_one_line(cells, why):
    with pytest.raises(PlacementError, match=why):
        plan(fellows(4), 2, 12, replicas=2).without(cells)
