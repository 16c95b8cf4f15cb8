"""SWARM's rebalancing rule (issue 34 point 3): a peer of the stage with throughput to spare
moves to the stage that bounds the pipeline, where that raises what the pipeline can do."""

from __future__ import annotations

import pytest

from swarm_core.contract.rebalance import capacity, choose_move


def test_the_issues_case_moves_a_stage_0_peer_to_the_stage_two_slowed_peers_hold_back():
    """S=2 x R=3, two stage-1 fellows slowed 4x: stage 1 does 1 + 1/4 + 1/4 = 1.5 micro-
    batches a second against stage 0's 3; a stage-0 peer moved there makes it 2 : 2.5, the
    pipeline 4/3 of what it was. A slowed peer going the other way (2.25 : 2.25) would gain
    12.5 % on paper, under the 20 % a move must promise; with a 10 % margin it goes."""
    for margin, expected in ((0.2, [(0, 1, 1.5, 2.0)]),
                             (0.1, [(0, 1, 1.5, 2.0), (1, 0, 2.0, 2.25)])):
        speeds = [{0: 1.0, 1: 1.0, 2: 1.0}, {0: 1.0, 1: 0.25, 2: 0.25}]
        moves = []
        while (move := choose_move(speeds, margin)) is not None:
            moves.append(move)
            speed = speeds[move.source].pop(move.cell)
            speeds[move.target][max(speeds[move.target]) + 1] = speed
            assert capacity(speeds) == move.after
        assert [(m.source, m.target, m.before, m.after) for m in moves] == expected
        assert moves[0].gain == pytest.approx(4 / 3)
        assert [m.cell for m in moves] == [2] * len(expected)  # (of equals the highest id)


def test_the_mover_is_the_one_whose_move_leaves_the_most():
    """Of a donor stage with a fast and a slow peer, the one that raises the bottleneck most:
    here the slow one (moving the fast one would make the donor the bottleneck)."""
    move = choose_move([{0: 2.0, 1: 2.0, 2: 1.5}, {0: 2.0, 1: 0.5}, {0: 10.0}])
    assert move is not None and (move.source, move.cell, move.target) == (0, 2, 1)
    assert (move.before, move.after) == (2.5, 4.0)  # (cell 1's would leave 3.5)


def test_a_mover_is_as_fast_at_its_new_stage_as_its_share_of_its_stages_fastest():
    """Stages cost unlike (stage 0's fastest twice stage 1's a micro-batch): a peer at 2 of
    stage 0's 2 is taken to do 1 at stage 1, not 2: stage 1 goes from 1.5 to 2.5 (not 3.5),
    stage 0 from 5 to 3."""
    move = choose_move([{0: 2.0, 1: 2.0, 2: 1.0}, {0: 1.0, 1: 0.5}])
    assert move is not None and (move.source, move.cell, move.target) == (0, 1, 1)
    assert (move.before, move.after) == (1.5, 2.5)


@pytest.mark.parametrize("speeds", [
    [{0: 1.0, 1: 1.0}, {0: 1.0, 1: 0.95}],  # (balanced within noise)
    [{0: 5.0}, {0: 1.0, 1: 1.0}],  # (the donor has one peer: a stage keeps one)
    [{0: 1.0, 1: 1.0}],  # (one stage)
    [{0: 1.0, 1: 1.05}, {0: 0.9, 1: 1.0}],  # (a move would gain less than 20 %)
    [{0: 1.0, 1: 1.0}, {0: 1.0, 1: 0.25, 2: 0.25, 3: 1.0}],  # (+12.5 % on paper: stays)
    [{0: 3.0, 1: 0.05}, {0: 1.0}],  # (only the leading cell would help, and it stays)
])
def test_no_move_where_none_raises_the_pipeline_by_the_margin(speeds):
    assert choose_move(speeds) is None
