"""A swarm-wired job whose stages have unequal numbers of cells (issue 34 point 3, the ground
SWARM's rebalancing stands on): a stage with fewer cells than the job's data shares, or with
extra ones, still computes what one process computes at the same global batch."""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.metrics import step_loss
from swarm_core.contract.placement import complete, split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.layout import check_layout, check_weights
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.pace import Pace
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.routing import ThroughputEstimate, route_plan, runs
from swarm_core.pipeline.stage import StageResult
from swarm_core.schema import structure

MODEL: dict[str, Any] = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _losses(res: dict[int, StageResult | BaseException], layout: list[list[int]]
            ) -> list[float]:
    """Each step's loss: the last stage's cells' (each the mean over the micro-batches its
    route gave it), weighted by those micro-batches."""
    stages = len(layout)
    last = [res[r * stages + stages - 1] for r in layout[-1]]
    assert all(isinstance(c, StageResult) for c in last), last
    return [step_loss(dict(enumerate(losses)), dict(enumerate(ran)))
            for losses, ran in zip(zip(*(c.losses for c in last), strict=True),  # type: ignore
                                   zip(*(c.micro_batches for c in last), strict=True),  # type: ignore
                                   strict=True)]


def _exact(data, layout: list[list[int]], weights: list[list[float]] | None, clip: float,
           steps: int, routing: Literal["given", "measured"] = "given", stage_kwargs=None,
           eval_batches: int = 0, shares: int = 2) -> dict[int, StageResult | BaseException]:
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": steps, "batch_size": 16, "micro_batches": 4, "seed": 11,
                    "eval_batches": eval_batches, "grad_clip": clip}, TrainingConfig)
    ref, model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1] * len(layout)))
    res = run_local_pipeline(mc, tc, data, len(layout), replicas=shares, timeout=240,
                             wiring="swarm", route_weights=weights, routing=routing,
                             layout=layout, stage_kwargs=stage_kwargs)
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    assert sorted(res) == sorted(r * len(layout) + k for k, ids in enumerate(layout)
                                 for r in ids)  # (only the layout's cells ran)
    got = _losses(res, layout)
    assert len(got) == steps and ref[-1] < ref[0]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)
    if eval_batches:
        with torch.no_grad():
            x, y = data.eval_batches(1, tc.batch_size // tc.micro_batches, mc.seq_len)[0]
            logits = model(x)
            expected = float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        last = res[len(layout) - 1]
        assert isinstance(last, StageResult)
        assert last.metrics.eval_loss == pytest.approx(expected, abs=1e-5)
    return res


def test_a_layout_s_plan_deals_each_stage_to_its_own_cells():
    """Stage 0 of one cell runs all R x M micro-batches; a stage of three (ids 0, 1 and the
    extra 2) is dealt by its weights, by id; the uniform layout's plan is today's."""
    plan = route_plan(7, 3, 2, 2, 4, [[1, 1, 1], [3, 1, 2]], layout=[[0], [0, 1, 2]])
    assert plan[0] == [0] * 8
    assert sorted(runs(plan, 1, 0) + runs(plan, 1, 1) + runs(plan, 1, 2)) == list(range(8))
    # (3 : 1 : 2 of eight: 4, then 1 and 3 or 2 and 2 as the balancer's random ties fall)
    assert [len(runs(plan, 1, r)) for r in range(3)] in ([4, 1, 3], [4, 2, 2])
    more = route_plan(7, 3, 2, 2, 4, [[1, 2, 1], [1, 1]], layout=[[0, 1, 2], [0, 1]])
    assert all(runs(more, 0, r) for r in range(3)) and -1 not in more[0]  # (stage 0 dealt)
    uniform = [[1, 1], [3, 1]]
    assert check_layout([[0, 1], [0, 1]], 2, 2) is None  # (the uniform layout: today's plan)
    # (a layout whose stage 0 has the shares' ids still deals stage 0 by weight: a slow peer
    # moved there gets its share's worth only as its weight says)
    dealt = route_plan(7, 3, 2, 2, 4, [[3, 1, 1], [1, 1, 1]], layout=[[0, 1], [0, 1, 2]])
    assert (len(runs(dealt, 0, 0)), len(runs(dealt, 0, 1))) == (6, 2)
    assert route_plan(7, 3, 2, 2, 4, uniform)[0] == [0] * 4 + [1] * 4
    # (a replica that left: its share is run by nobody, its cells dealt none)
    left = route_plan(7, 3, 2, 2, 4, [[1, 1, 1], [1, 1, 1]], members=[0, 2],
                      layout=[[0], [0, 1, 2]])
    assert left[0] == [0] * 4 + [-1] * 4 and not runs(left, 1, 1)


@pytest.mark.parametrize("layout, weights, clip", [
    ([[0], [0, 1, 2]], [[1, 1, 1], [3, 1, 2]], 1.0),  # a stage of one, a stage of three
    ([[0], [0, 1, 2]], [[1, 1, 1], [3, 1, 2]], 0.0),
    ([[0, 1, 2], [0, 1]], [[1, 2, 1], [3, 1, 1]], 1.0),  # stage 0 dealt to three cells
    ([[0, 1, 2], [0, 1]], [[1, 2, 1], [3, 1, 1]], 0.0),
])
def test_a_layout_of_unequal_stages_computes_what_one_process_computes(data, layout, weights,
                                                                       clip):
    """``none``, fp32, dp, two data shares: S=2 with unequal stages computes the losses of one
    process at the same global batch to 1e-5, with clipping (the NORM relay) and without;
    replica 0's chain evaluates."""
    res = _exact(data, layout, weights, clip, 12, eval_batches=1 if clip else 0)
    # Each stage's cells together ran the step's 8 micro-batches, skewed by the weights.
    for k, ids in enumerate(layout):
        ran = [res[r * 2 + k].metrics.micro_batches for r in ids]  # type: ignore[union-attr]
        assert sum(ran) == pytest.approx(8.0), (k, ran)


def test_a_three_stage_layout_with_a_middle_stage_of_three_computes_what_one_process_does(
        data):
    """Ids 1 and 2 have no whole chain: both hear the norm from id 0's cells."""
    layout = [[0, 1], [0, 1, 2], [0]]
    _exact(data, layout, [[1, 1, 1], [1, 3, 2], [1, 1, 1]], 1.0, 8)


def test_a_job_of_one_share_with_a_second_cell_at_its_last_stage_computes_the_same(data):
    """R=1: the extra cell is the only one beside the shares' chain (the divisor is 1)."""
    res = _exact(data, [[0], [0, 1]], [[1, 1], [1, 2]], 1.0, 8, shares=1)
    ran = [res[c].metrics.micro_batches for c in (1, 3)]  # type: ignore[union-attr]
    assert sum(ran) == pytest.approx(4.0) and ran[0] < ran[1], ran  # (the step's 4, 1 : 2)


def test_measured_routes_over_a_layout_compute_what_one_process_computes(data):
    """``routing: measured``: each cell's time goes round its group's ring and up id 0's
    chain; cells without a whole chain hear the table by the relay, so every cell deals the
    same plan, and a slow extra cell (id 2, 6x) gets fewer of stage 1's micro-batches."""
    res = _exact(data, [[0], [0, 1, 2]], None, 1.0, 10, routing="measured",
                 stage_kwargs={2 * 2 + 1: {"pace": Pace(6.0)}})
    fast, slow = (res[c].metrics.micro_batches for c in (1, 5))  # type: ignore[union-attr]
    assert slow < fast, (fast, slow)


def test_a_bad_layout_is_refused_in_one_line():
    for layout, what in [([[0], []], "stage 1 has no cells"),
                         ([[0], [1, 2]], "stage 1 has no cell 0"),
                         ([[0]], "1 stages listed for a 2-stage job"),
                         ([[0, 0], [0]], "must be distinct")]:
        with pytest.raises(ValueError, match=what):
            check_layout(layout, 2, 2)
    with pytest.raises(ValueError, match=r"need sync\.mode dp, not diloco"):
        check_layout([[0], [0, 1]], 2, 2, "diloco")
    with pytest.raises(ValueError, match="need wiring swarm"):
        check_layout([[0], [0, 1]], 2, 2, "dp", "chain")
    assert check_layout([[1, 0], [0, 1]], 2, 2) is None  # (the uniform layout: today's job)
    with pytest.raises(ValueError, match=r"must be 2 lists \(stages\) of 3 weights"):
        check_weights([[1, 1], [1, 1, 1]], 2, 3)
    with pytest.raises(ValueError, match="every weight must be a positive number"):
        check_weights([[1, 1, 0], [1, 1, 1]], 2, 3)
    assert complete(((0,), (0, 1)), 0) and not complete(((0,), (0, 1)), 1)
    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 1, "batch_size": 16, "sync": {"mode": "diloco"}}, TrainingConfig)
    with pytest.raises(ValueError, match=r"need sync\.mode dp"):
        run_local_pipeline(mc, tc, None, 2, replicas=2, wiring="swarm",  # type: ignore
                           layout=[[0], [0, 1, 2]])


class _LastStage:
    """Each step's reports of the last stage's cells (whichever cells ran it: moves change
    them), and the step's loss from them (``step_loss``, weighted by micro-batches)."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        self.reports: dict[int, dict[int, tuple[float, int]]] = {}

    def on_step(self, cell: int, rep) -> None:
        if cell % self.stages == self.stages - 1:
            self.reports.setdefault(rep.step - 1, {})[cell] = (rep.loss, rep.micro_batches)

    def losses(self) -> list[float]:
        return [step_loss({c: v[0] for c, v in by_cell.items()},
                          {c: v[1] for c, v in by_cell.items()})
                for _step, by_cell in sorted(self.reports.items())]


class _SentByStep:
    """Every cell's pipeline bytes of each step, summed (reports' ``wire_tx_bytes``)."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def on_step(self, _cell: int, rep) -> None:
        self.sent[rep.step] = self.sent.get(rep.step, 0) + rep.wire_tx_bytes


def _moved_losses(res: dict[int, StageResult | BaseException], before: list[list[int]],
                  after: list[list[int]], at: int, steps: int) -> list[float]:
    """Each step's loss over the last stage's cells of the layout it ran under (a cell the
    move adds reports from step ``at``, one it takes away up to it)."""
    stages, out = len(before), []
    for s in range(steps):
        losses, ran = {}, {}
        for r in (before if s < at else after)[-1]:
            cell = res[r * stages + stages - 1]
            assert isinstance(cell, StageResult)
            i = s - (at if r not in before[-1] else 0)
            losses[r], ran[r] = cell.losses[i], cell.micro_batches[i]
        out.append(step_loss(losses, ran))
    return out


@pytest.mark.parametrize("before, after, weights, clip, routing", [
    # stage 0's second cell moves to stage 1 as a third (an even job made uneven)
    ([[0, 1], [0, 1]], [[0], [0, 1, 2]], [[1, 1, 1], [3, 1, 2]], 1.0, "given"),
    # stage 0's extra cell moves to stage 1 (the fast stage gives a peer to the slow one)
    ([[0, 1, 2], [0, 1]], [[0, 1], [0, 1, 2]], [[1, 2, 1], [3, 1, 1]], 0.0, "given"),
    # back to an even job, under measured routes (every cell's estimate starts afresh)
    ([[0], [0, 1, 2]], [[0, 1], [0, 1]], None, 1.0, "measured"),
])
def test_a_peer_moved_between_stages_at_a_step_boundary_computes_what_one_process_does(
        data, before, after, weights, clip, routing):
    """At step 5 every cell re-links under the new layout; the cell the move adds takes its
    stage's weights and AdamW state from id 0's cell round the new ring, and the losses are
    one process's to 1e-5 before and after the move (the first chain's eval too)."""
    mc = ModelConfig(**MODEL)
    steps, at = 10, 5
    tc = structure({"steps": steps, "batch_size": 16, "micro_batches": 4, "seed": 11,
                    "eval_batches": 1, "grad_clip": clip}, TrainingConfig)
    ref, model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    res = run_local_pipeline(mc, tc, data, 2, replicas=2, timeout=240, wiring="swarm",
                             route_weights=weights, routing=routing, layout=before,
                             relayout=(at, after))
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    got = _moved_losses(res, before, after, at, steps)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)
    with torch.no_grad():
        x, y = data.eval_batches(1, tc.batch_size // tc.micro_batches, mc.seq_len)[0]
        logits = model(x)
        expected = float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    last = res[1]
    assert isinstance(last, StageResult)
    assert last.metrics.eval_loss == pytest.approx(expected, abs=1e-5)
    # The cell that left trained the steps before the move; the one that came, those after.
    gone = next(r * 2 + k for k in range(2) for r in before[k] if r not in after[k])
    came = next(r * 2 + k for k in range(2) for r in after[k] if r not in before[k])
    assert (res[gone].metrics.steps, res[came].metrics.steps) == (at, steps - at)


def test_rebalancing_moves_a_peer_to_the_stage_slowed_peers_hold_back_and_stays_exact(
        data, monkeypatch):
    """SWARM's adaptive rebalancing, decided in band: S=2 x R=3 under measured routes, two
    of stage 1's three peers slowed 10x. Every three steps every cell reads the same table of
    measured throughput (here the emulation's own: six threads on two cores measure each
    other's contention, not machines; bench_hetero measures the real thing), and at the first
    look stage 0's cell 2 moves to stage 1 as its cell 3 (stage 1 from 1.2 to 2.2 units,
    stage 0 from 3 to 2): its thread, its fellow, goes on there, every cell re-links, the
    newcomer takes stage 1's state from cell 0. The next look finds no move worth 10 %
    (a slowed peer back to stage 0 would make it 2.1 : 2.1). The losses stay one process's to
    1e-5. Under a link matrix placing each replica's chain at a site of its own: the moved
    peer keeps its site (its fellow's), whatever its new id (before, id 3 had none and its
    links failed to open). The step after the move is dealt by the speeds measured before
    it, the moved peer's going with it: the slowed cells run fewer of stage 1's
    micro-batches than the others (dealt afresh, all four would run three)."""
    mc = ModelConfig(**MODEL)
    steps, stages, slow = 9, 2, {1, 2}
    sites = {"sites": {s: {} for s in "abc"}, "default": {"mbps": 1000},
             "replica_sites": ["a", "b", "c"]}
    tc = structure({"steps": steps, "batch_size": 24, "micro_batches": 4, "seed": 3,
                    "eval_batches": 0, "grad_clip": 1.0, "network": sites}, TrainingConfig)
    ref, _model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))

    def emulated(self, layout):
        return [{r: 0.1 if (k, r) in {(1, s) for s in slow} else 1.0 for r in ids}
                for k, ids in enumerate(layout)]

    # (the estimate's samples too: what the deal after the move reads, the moved peer's
    # carried in; timed, a loaded machine's noise once dealt a slowed cell the most)
    timed = ThroughputEstimate.update

    def samples(self, seconds):
        timed(self, [[(10.0 if (k, r) in {(1, s) for s in slow} else 1.0) if x > 0 else x
                      for r, x in enumerate(row)] for k, row in enumerate(seconds)])

    monkeypatch.setattr(ThroughputEstimate, "measured", emulated)
    monkeypatch.setattr(ThroughputEstimate, "update", samples)
    last = _LastStage(stages)

    moves: list = []
    res = run_local_pipeline(mc, tc, data, stages, replicas=3, timeout=240, wiring="swarm",
                             routing="measured", rebalance=3, on_step=last.on_step,
                             on_move=moves.append,
                             stage_kwargs={r * stages + 1: {"pace": Pace(10.0)} for r in slow})
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    assert [(m.at, m.before, m.after, m.epoch) for m in moves] == [
        (3, None, ((0, 1), (0, 1, 2, 3)), 1)]
    assert moves[0].placement.site(1, 3) == "c"  # (stage 0's cell 2's: replica 2's site)
    came = res[3 * stages + 1]
    assert isinstance(came, StageResult) and came.metrics.steps == steps - 3
    assert isinstance(res[2 * stages], StageResult) and res[2 * stages].metrics.steps == 3
    got = last.losses()
    assert len(got) == steps
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)
    ran = {cell // stages: mbs for cell, (_loss, mbs) in last.reports[3].items()}
    assert sorted(ran) == [0, 1, 2, 3] and sum(ran.values()) == 12, ran
    assert max(ran[1], ran[2]) < min(ran[0], ran[3]), ran


def test_a_moved_peer_takes_its_measured_speed_to_its_new_stage_and_the_stayers_keep_theirs():
    """Measured routes across a move (``ThroughputEstimate.carried``): every cell that stays
    keeps its samples; the moved peer's speed goes with it, scaled by the two stages' fastest
    cells (the rebalancing rule's prediction) and counted as one sample, so the step after
    the move is dealt by what was measured, not equally; its first sample there weighs about
    as much as the carried one. A peer moved before anything was measured brings nothing."""
    est = ThroughputEstimate(2, 3)
    for _ in range(5):
        est.update([[0.01, 0.01, 0.02], [0.005, 0.02, 0.02]])
    before = est.weights()
    after = ((0, 1), (0, 1, 2, 3))
    moved = est.carried((0, 2, 1, 3), after, 3)
    w = moved.weights()
    assert w[0][:2] == pytest.approx(before[0][:2]) and w[1][:3] == pytest.approx(before[1][:3])
    # (half stage 0's fastest, 50 a second, there: half stage 1's fastest, 200 a second)
    assert w[1][3] == pytest.approx(100.0)
    plan = route_plan(0, 8, 2, 3, 4, w, layout=after)
    ran = [len(runs(plan, 1, r)) for r in range(4)]
    assert sum(ran) == 12 and max(ran[1], ran[2]) < ran[3] < ran[0], ran
    fresh = ThroughputEstimate(2, 4, layout=after)
    assert fresh.weights()[1] == [1.0] * 4  # (what the step after a move was dealt by)
    moved.update([[0.01, 0.01, float("nan"), float("nan")], [0.005, 0.02, 0.02, 0.02]])
    # (the carried 0.01 s a micro-batch and its own 0.02: 0.19 / (0.1*0.02 + 0.9*0.001))
    assert moved.weights()[1][3] == pytest.approx(0.19 / (0.1 * 0.02 + 0.9 * 0.001))
    unmeasured = ThroughputEstimate(2, 3).carried((0, 2, 1, 3), after, 3)
    assert unmeasured.updates[1] == [0, 0, 0, 0] and unmeasured.weights()[1] == [1.0] * 4
    # (measured routes' prior, the given weights, goes alike: the peer's own, unscaled)
    prior = ThroughputEstimate(2, 3, given=[[1, 1, 2], [1, 0.5, 0.5]])
    assert prior.carried((0, 2, 1, 3), after, 3).weights()[1] == [1.0, 0.5, 0.5, 2.0]


def test_a_given_peer_move_is_made_as_a_decided_one_and_stays_exact(data):
    """A move given in advance (a job's ``topology.moves``), as fellows run it: every cell
    computes the moved placement from its START at the same boundary; the peer's thread (its
    fellow) goes on as its new cell, from the START the move gives it, keeping its listener.
    S=2 x R=2: stage 0's cell 1 becomes stage 1's cell 2 before step 4 of 8; the losses are
    one process's to 1e-5."""
    from swarm_core.contract.rebalance import PeerMove

    mc = ModelConfig(**MODEL)
    steps, at = 8, 4
    tc = structure({"steps": steps, "batch_size": 16, "micro_batches": 4, "seed": 9,
                    "eval_batches": 0, "grad_clip": 1.0}, TrainingConfig)
    ref, _model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    moves: list = []
    named: dict[int, set] = {}
    res = run_local_pipeline(mc, tc, data, 2, replicas=2, timeout=240, wiring="swarm",
                             moves=[PeerMove(at=at, source=0, cell=1, target=1)],
                             on_move=moves.append,
                             on_step=lambda _c, rep: named.setdefault(rep.step, set()).add(
                                 (rep.epoch, rep.moved)))
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    assert [(m.at, m.after, m.peer) for m in moves] == [(at, ((0,), (0, 1, 2)), (0, 1, 1, 2))]
    got = _moved_losses(res, [[0, 1], [0, 1]], [[0], [0, 1, 2]], at, steps)
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)
    assert (res[2].metrics.steps, res[5].metrics.steps) == (at, steps - at)
    # Every cell's report names the layout it ran under: the moves so far and the latest
    # (how the leader learns of a move, whichever cell's report it reads first).
    made = PeerMove(at=at, source=0, cell=1, target=1, new_id=2)
    assert all(named[s] == {(0, None)} for s in range(1, at + 1))
    assert all(named[s] == {(1, made)} for s in range(at + 1, steps + 1))


def test_a_peer_that_stayed_through_a_move_moves_from_the_placement_it_made(data):
    """Two moves, the second by a peer that stayed through the first: its START is the one
    it began with, which predates the first move, so its new cell must come from the
    placement the move made (a fellow's run of this waited a minute for a cell that had
    left, then failed). S=2 x R=2: 0.1 -> 1.2 before step 3, then 1.1 -> 0.1 before step 6;
    every step's loss is one process's to 1e-5."""
    from swarm_core.contract.rebalance import PeerMove

    mc = ModelConfig(**MODEL)
    steps, stages = 8, 2
    tc = structure({"steps": steps, "batch_size": 16, "micro_batches": 4, "seed": 5,
                    "eval_batches": 0, "grad_clip": 1.0}, TrainingConfig)
    ref, _model = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1]))
    last = _LastStage(stages)

    moves: list = []
    res = run_local_pipeline(mc, tc, data, stages, replicas=2, timeout=60, wiring="swarm",
                             moves=[PeerMove(at=3, source=0, cell=1, target=1),
                                    PeerMove(at=6, source=1, cell=1, target=0)],
                             on_move=moves.append, on_step=last.on_step)
    failed = {k: v for k, v in res.items() if not isinstance(v, StageResult)}
    assert not failed, failed
    assert [(m.at, m.after, m.peer) for m in moves] == [
        (3, ((0,), (0, 1, 2)), (0, 1, 1, 2)), (6, ((0, 1), (0, 2)), (1, 1, 0, 1))]
    # (the last stage's cells of each step: 1.0 and 1.1, then 1.0-1.2, then 1.0 and 1.2)
    assert [sorted(last.reports[s]) for s in range(steps)] == [[1, 3]] * 3 + [[1, 3, 5]] * 3 \
        + [[1, 5]] * 2
    got = last.losses()
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)


@pytest.mark.parametrize("layout, routing, clip, differs", [
    # (measured routes' table rides the exchange, clipping or not)
    (None, "measured", 0.0, True),
    # (id 0's stage-0 cell relays to 1.1 and 1.2, which send none: as many frames as 2x2's)
    ([[0], [0, 1, 2]], "given", 1.0, False),
    ([[0, 1, 2], [0]], "measured", 1.0, True),
    # (three stages: ids 1 and 2 have no whole chain; 1.0 relays to 0.1, 2.1 and 2.2, and
    # those send none: 7 NORM frames where a 3x2 grid's cells send 8)
    ([[0, 1], [0], [0, 1, 2]], "given", 1.0, True),
    ([[0, 1], [0], [0, 1, 2]], "measured", 1.0, True),
])
def test_a_routed_steps_frames_are_the_bytes_wire_math_expects(data, layout, routing, clip,
                                                              differs):
    """Each step the cells together send R x M micro-batches' ACT and GRAD frames (however
    the route dealt them) and their NORM frames: with measured routes each carries the
    chain's sum and the whole table; under a layout id 0's cells relay the result to the
    cells without a whole chain, which send none. Their sum is ``step_wire_bytes``'s, step
    by step (where the NORM frames differ from a grid's, so does the count)."""
    from swarm_core.pipeline.wire_math import step_wire_bytes

    mc = ModelConfig(**MODEL)
    stages = 2 if layout is None else len(layout)
    tc = structure({"steps": 3, "batch_size": 16, "micro_batches": 4, "seed": 2,
                    "eval_batches": 0, "grad_clip": clip}, TrainingConfig)
    frames = _SentByStep()

    res = run_local_pipeline(mc, tc, data, stages, replicas=2, timeout=120, wiring="swarm",
                             routing=routing, layout=layout, on_step=frames.on_step)
    assert all(isinstance(v, StageResult) for v in res.values()), res
    expected = step_wire_bytes(mc, tc, stages, 2, layout, routing == "measured")
    assert (expected != step_wire_bytes(mc, tc, stages, 2)) == differs  # (a grid's count)
    assert frames.sent == {step: expected for step in (1, 2, 3)}


def test_a_moved_runs_frames_are_the_mean_of_each_layouts(data):
    """A peer moved before step 2 of 4 under measured routes: the steps before send the
    grid's frames, the steps after the new layout's (its relays, its wider table);
    ``run_wire_bytes`` is their mean over the run."""
    from swarm_core.contract.rebalance import PeerMove
    from swarm_core.pipeline.wire_math import run_wire_bytes, step_wire_bytes

    mc = ModelConfig(**MODEL)
    tc = structure({"steps": 4, "batch_size": 16, "micro_batches": 4, "seed": 2,
                    "eval_batches": 0, "grad_clip": 1.0}, TrainingConfig)
    frames = _SentByStep()

    res = run_local_pipeline(mc, tc, data, 2, replicas=2, timeout=120, wiring="swarm",
                             routing="measured", on_step=frames.on_step,
                             moves=[PeerMove(at=2, source=0, cell=1, target=1)])
    assert not [v for v in res.values() if not isinstance(v, StageResult)], res
    before = step_wire_bytes(mc, tc, 2, 2, None, True)
    after = step_wire_bytes(mc, tc, 2, 2, [[0], [0, 1, 2]], True)
    assert before != after and frames.sent == {1: before, 2: before, 3: after, 4: after}
    assert run_wire_bytes(mc, tc, 2, 2, None, True, [(2, 0, 1, 1, 2)]) == (before + after) / 2
