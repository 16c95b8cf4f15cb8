from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm_core.contract.placement import FellowSlots, PlacementError, plan, split_layers
from swarm_core.pipeline.schedules import (
    eager,
    gpipe,
    hurried_backwards,
    max_in_flight,
    one_f_one_b,
)
from swarm_core.schema import unstructure


def test_largest_remainder_split():
    assert split_layers(8, [1, 1]) == [(0, 4), (4, 8)]
    assert split_layers(10, [1, 1, 1]) == [(0, 4), (4, 7), (7, 10)]
    assert split_layers(10, [3, 1]) == [(0, 8), (8, 10)]  # 7.5/2.5: tie goes to the first
    assert split_layers(5, [0, 0]) == [(0, 3), (3, 5)]  # all zero counts as equal
    assert split_layers(6, [0, 1, 1]) == [(0, 0), (0, 3), (3, 6)]


@given(st.integers(0, 200), st.lists(st.floats(0, 100), min_size=1, max_size=12))
def test_split_sums_exactly_and_is_contiguous(n, weights):
    ranges = split_layers(n, weights)
    assert len(ranges) == len(weights)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert sum(b - a for a, b in ranges) == n


def test_negative_weight_refused():
    with pytest.raises(PlacementError, match=">= 0"):
        split_layers(4, [1, -1])


def test_plan_fills_a_fellows_slots_first():
    fellows = [FellowSlots(0, "a", ["cuda:0", "cuda:1"], "h:1"),
               FellowSlots(3, "b", ["cpu"], "h:2")]
    p = plan(fellows, 3, 12)
    assert [(s.stage, s.fellow_id, s.slot, s.device, s.layers.as_tuple()) for s in p.stages] == [
        (0, 0, 0, "cuda:0", (0, 4)), (1, 0, 1, "cuda:1", (4, 8)), (2, 3, 0, "cpu", (8, 12))]
    doc = unstructure(p)
    assert doc["stages"][2]["layers"] == {"start": 8, "stop": 12}
    assert doc["stages"][2]["data_addr"] == "h:2"


def test_the_fellows_of_a_stage_group_or_a_replica_each_once():
    """A 2 x 2 grid on three fellows, the first with two slots (replica 0's chain): a stage
    group, a replica's chain, a cell, or the whole job, each fellow named once."""
    fellows = [FellowSlots(5, "a", ["cpu", "cpu"], "h:1"), FellowSlots(6, "b", ["cpu"], "h:2"),
               FellowSlots(7, "c", ["cpu"], "h:3")]
    p = plan(fellows, 2, 4, replicas=2)
    assert [(s.stage, s.replica, s.fellow_id) for s in p.stages] == [
        (0, 0, 5), (1, 0, 5), (0, 1, 6), (1, 1, 7)]
    assert p.fellows_of(stage=1) == [5, 7]
    assert p.fellows_of(replica=0) == [5]  # (one fellow holds the chain: named once)
    assert p.fellows_of(1, 1) == [7]
    assert p.fellows_of() == [5, 6, 7]
    # Replica 1 left: the stage group is replica 0's fellow alone.
    assert p.fellows_of(stage=1, members=[0]) == [5]
    assert p.fellows_of(replica=1, members=[0]) == []


def test_plan_needs_enough_slots():
    with pytest.raises(PlacementError, match="3 stages need 3 device slots, the fellows offer 2"):
        plan([FellowSlots(0, "a", ["cpu"]), FellowSlots(1, "b", ["cpu"])], 3, 6)


@pytest.mark.parametrize("stages, m", [(1, 4), (2, 8), (4, 8), (4, 2)])
def test_schedules_run_every_op_once_with_backwards_in_order(stages, m):
    for s in range(stages):
        for sched in (gpipe, one_f_one_b, eager):
            ops = sched(s, stages, m)
            every = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            assert sorted(ops) == sorted(every)
            assert [i for k, i in ops if k == "B"] == list(range(m))
            for k, i in ops:  # a backward never precedes its forward
                if k == "B":
                    assert ops.index(("F", i)) < ops.index(("B", i))


def test_1f1b_bounds_activations_gpipe_does_not():
    assert max_in_flight(gpipe(0, 4, 8)) == 8
    assert [max_in_flight(one_f_one_b(s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]


def test_eager_schedule_shape():
    # Early stages: every forward first; the last stage: forward, backward, forward, ...
    assert eager(0, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert eager(1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_split_backward_hurries_only_backwards_a_neighbour_waits_behind():
    # A stage with an upstream neighbour sends every backward's input gradient: all hurry.
    for sched in (gpipe, one_f_one_b, eager):
        assert hurried_backwards(sched(1, 2, 4), first=False) == {0, 1, 2, 3}
    # The first stage sends only activations: a backward hurries when a forward follows it.
    assert hurried_backwards(gpipe(0, 2, 4), first=True) == set()
    assert hurried_backwards(eager(0, 3, 4), first=True) == set()
    # 1F1B on 2 stages: F0 F1 B0 F2 B1 F3 B2 B3
    assert hurried_backwards(one_f_one_b(0, 2, 4), first=True) == {0, 1}
    # 1F1B on 3 stages: F0 F1 F2 B0 F3 B1 B2 B3
    assert hurried_backwards(one_f_one_b(0, 3, 4), first=True) == {0}
