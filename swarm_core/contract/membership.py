"""Who trains in a job of several replicas, and how its stage groups agree when one leaves.

A replica is a chain: replica r of every stage. When a member of a stage group dies, every
survivor's ring breaks at its next synchronisation (the dead member's links close, or go
quiet). Each survivor then reports a :class:`RegroupReport` and waits; a cell of the dead
member's chain finds its pipeline link broken and fails. Once every cell is accounted for, one
rule (:func:`regroup_orders`, run by the leader, or by the in-process coordinator of
``run_local_pipeline``) tells each survivor the replicas it trains with from now on and what
to do with the synchronisation it was in:

* A ring operation is committed on a member only after it heard that every member finished
  it (the ring's confirmation round, see ``pipeline/ring.py``). So if any survivor committed
  the operation at step s, every member had finished it, and those that had not yet heard so
  commit it too (``commit``): they hold the same result.
* An operation no survivor committed is done again by all of them over the new ring
  (``redo``): each still holds its own part (gradients, or the weights' change since the last
  outer step), since a result is only applied once committed.

Under swarm wiring a micro-batch crosses replicas, so a lost cell breaks the other chains'
pipelines too, and no survivor holds a whole step of its stage's gradients to commit. There
the rule is :func:`routed_orders`: the survivors are at most one step apart (a cell applies
step s only after every cell ran s's forward, which each began after applying s - 1), so all
train on from the earliest step a survivor had not applied, a cell that had applied it
undoing it first, over the members left: every micro-batch of the redone step is routed to
a survivor and counted once. Of a dp job, the rule is :func:`cell_orders` where it can be:
a lost cell (not a stage's cell 0) leaves alone, its id's other cells train on, and the
job's batch is kept (the layout without the cell deals every share's micro-batches).

Torch-free: the leader decides with it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import attrs

from swarm_core.contract.placement import Layout, Placement, normal_layout, stage_ids
from swarm_core.contract.rebalance import PeerMove
from swarm_core.schema import converter, lenient_converter, make_dict_unstructure_fn, override
from swarm_core.validators import MAX_STEPS, bounded, meta, non_negative, step_number


@attrs.define
class RegroupReport:
    """A cell whose stage group's ring broke: where it stands."""

    fellow_id: int = attrs.field(validator=non_negative, metadata=meta("", minimum=0))
    stage: int = attrs.field(validator=non_negative, metadata=meta("", minimum=0))
    replica: int = attrs.field(validator=non_negative, metadata=meta("", minimum=0))
    attempt: int = attrs.field(default=0, validator=non_negative,
                               metadata=meta("the START's attempt", minimum=0))
    epoch: int = attrs.field(default=0, validator=non_negative,
                             metadata=meta("the membership the cell trained in", minimum=0))
    op_step: int = attrs.field(default=0, validator=step_number,
                               metadata=meta("the step of the synchronisation that broke "
                                             "(0-based; below the job's steps)", minimum=0,
                                             maximum=MAX_STEPS))
    synced_step: int = attrs.field(default=-1, validator=bounded(-1, MAX_STEPS), metadata=meta(
        "the step of the last synchronisation the cell committed; -1: none this attempt",
        minimum=-1, maximum=MAX_STEPS))
    finished: bool = attrs.field(default=False, metadata=meta(
        "whether the cell had its result of the broken synchronisation, unconfirmed"))
    closed_by: int | None = attrs.field(default=None, validator=non_negative, metadata=meta(
        "a replica whose link to this cell closed without a FAREWELL (it likely died): a "
        "ring neighbour's, or under swarm wiring a pipeline neighbour's", minimum=0))
    routed: bool = attrs.field(default=False, metadata=meta(
        "a swarm-wired cell whose step broke: op_step is the step it had not applied (it "
        "applied every step before it)"))


@attrs.define
class RegroupOrder:
    """The leader's answer to a :class:`RegroupReport`."""

    epoch: int  # the new membership's
    members: list[int]  # the replicas that train from now on, in ring order
    commit: bool = False  # apply the broken synchronisation's result (others did)
    drop: bool = False  # this cell's chain is out: end it
    # A replica joins: the member that hands it the stage's state (weights, optimiser and
    # outer state) around the new ring.
    donor: int | None = None
    # Swarm wiring: every member trains on from this step (0-based); a cell that had applied
    # it undoes it first (see routed_orders).
    redo_step: int | None = None
    # Swarm wiring, a cell-wise departure (see cell_orders): the job's cell ids by stage from
    # the order on (a cell it lacks is out); ``members`` are then the ids it names.
    layout: list[list[int]] | None = None


@attrs.define
class MembersSignal:
    """The leader's MEMBERS signal to a cell of a running job of replicas: a replica joins;
    move to ``order``'s membership at the group's next synchronisation (``placement`` says
    where the new member listens)."""

    stage: int
    replica: int
    attempt: int
    order: RegroupOrder
    placement: Placement


@attrs.define
class RegroupAnswer:
    """``POST /jobs/{id}/regroup``'s answer: the order, or null while the round is still
    being gathered (ask again with the same report)."""

    order: RegroupOrder | None = None


@attrs.define
class MembershipChange:
    """A record of who left or joined a job of several replicas, and at which step: a loss
    curve is read against these."""

    step: int  # the first step trained without those who left (with those who joined)
    epoch: int
    members: list[int]  # the replicas training from ``step`` on
    left: list[int] = attrs.field(factory=list)
    joined: list[int] = attrs.field(factory=list)
    reason: str = ""
    at: float | None = None  # wall clock
    # Of a departure, by stage: the first step that stage's group trained without those who
    # left. With several stages they may differ by one: a group whose members had all
    # finished the broken step's synchronisation keeps it (``step`` is the earliest).
    stage_steps: list[int] = attrs.field(factory=list)
    # A peer moved between stages (a swarm layout's rebalancing): nobody left or joined;
    # ``members`` are the ids the job's stages have from ``step`` on.
    moved: PeerMove | None = None
    # Swarm wiring: cells (stage, id) that left while their ids' other cells train on (a
    # cell-wise departure: ``cell_orders``); ``members`` are the ids the job still has.
    cells_left: list[list[int]] = attrs.field(factory=list)

    @property
    def departed(self) -> bool:
        """Whether anyone left: a replica, or a cell of a swarm job."""
        return bool(self.left or self.cells_left)

    def left_text(self) -> str:
        """Who left, for a person: "replica(s) 1,2 left", "cell(s) 1.1 left"; empty where
        nobody did."""
        parts = [f"replica(s) {','.join(map(str, self.left))} left"] if self.left else []
        if self.cells_left:
            parts.append(f"cell(s) {self.cells_text()} left")
        return "; ".join(parts)

    def cells_text(self) -> str:
        """The cells that left, "1.1,0.2" (stage.id)."""
        return ",".join(f"{k}.{r}" for k, r in self.cells_left)


class RegroupConflict(ValueError):
    """The survivors' reports do not fit together (a member committed what another had not
    finished): the job recovers as without replicas."""


def regroup_orders(reports: Mapping[tuple[int, int], RegroupReport], stages: int,
                   broken: Collection[int], epoch: int
                   ) -> tuple[list[int], dict[tuple[int, int], RegroupOrder]]:
    """The replicas that go on (every cell reported, the chain not ``broken``) and the order
    for each reporting cell, by (stage, replica). Raises RegroupConflict where no order keeps
    the group's members equal; an empty list of members means none goes on."""
    replicas = {r for _s, r in reports}
    members = sorted(r for r in replicas if r not in broken
                     and all((s, r) in reports for s in range(stages)))
    orders: dict[tuple[int, int], RegroupOrder] = {}
    for s in range(stages):
        orders.update(group_orders({r: reports[(s, r)] for r in members}, s, members, epoch))
    for (s, r) in reports:
        if r not in members:
            orders[(s, r)] = RegroupOrder(epoch, members, drop=True)
    return members, orders


def routed_orders(reports: Mapping[tuple[int, int], RegroupReport], stages: int,
                  broken: Collection[int], epoch: int
                  ) -> tuple[list[int], dict[tuple[int, int], RegroupOrder]]:
    """Swarm wiring's rule: the replicas that go on (as :func:`regroup_orders`) all train on
    from the earliest step a surviving cell had not applied. Raises RegroupConflict where the
    survivors are further apart than the one step a cell can undo."""
    replicas = {r for _s, r in reports}
    members = sorted(r for r in replicas if r not in broken
                     and all((s, r) in reports for s in range(stages)))
    steps = [reports[(s, r)].op_step for s in range(stages) for r in members]
    orders: dict[tuple[int, int], RegroupOrder] = {}
    if steps:
        redo = min(steps)
        if max(steps) > redo + 1:
            raise RegroupConflict(f"the survivors stand at steps {redo} to {max(steps)}: "
                                  "further apart than one step")
        orders = {(s, r): RegroupOrder(epoch, members, redo_step=redo)
                  for s in range(stages) for r in members}
    for (s, r) in reports:
        if r not in members:
            orders[(s, r)] = RegroupOrder(epoch, members, drop=True)
    return members, orders


def cellwise_layout(layout: Layout | None, stages: int, shares: int,
                    lost: Collection[tuple[int, int]]) -> Layout | None:
    """The layout a swarm job trains on once the cells ``lost`` (stage, id) left it alone
    (their ids' other cells going on), or None where that rule cannot apply: a lost cell is
    its stage's cell 0 (id 0's chain evaluates and checkpoints: the job falls back to
    dropping whole replicas), or nobody is lost."""
    if not lost or any(r == 0 for _k, r in lost):
        return None
    shape = [[i for i in stage_ids(layout, k, shares) if (k, i) not in lost]
             for k in range(stages)]
    return normal_layout(shape, stages, shares) or tuple(tuple(ids) for ids in shape)


def cell_orders(reports: Mapping[tuple[int, int], RegroupReport], after: Layout, epoch: int
                ) -> dict[tuple[int, int], RegroupOrder]:
    """Swarm wiring's rule for a cell-wise departure (SWARM: a lost peer costs the swarm its
    throughput, not its batch): every cell of ``after`` (the layout without the lost cells,
    ``cellwise_layout``) trains on from the earliest step a survivor had not applied, as
    :func:`routed_orders`, with the job's batch kept: each stage deals all its shares'
    micro-batches to the cells it has left. ``reports``: every survivor's, by (stage, id);
    a reporting cell ``after`` lacks is told to drop. Raises RegroupConflict where the
    survivors are further apart than one step."""
    cells = [(k, r) for k, ids in enumerate(after) for r in ids]
    steps = [reports[c].op_step for c in cells]
    redo = min(steps)
    if max(steps) > redo + 1:
        raise RegroupConflict(f"the survivors stand at steps {redo} to {max(steps)}: "
                              "further apart than one step")
    ids = sorted({r for row in after for r in row})
    shape = [list(row) for row in after]
    orders = {c: RegroupOrder(epoch, ids, redo_step=redo, layout=shape) for c in cells}
    for c in reports:
        if c not in orders:
            orders[c] = RegroupOrder(epoch, ids, drop=True, layout=shape)
    return orders


def cell_departure(orders: Mapping[tuple[int, int], RegroupOrder], stages: int,
                   lost: Collection[tuple[int, int]], epoch: int, reason: str = "",
                   at: float | None = None) -> MembershipChange:
    """The record of a cell-wise departure (``cell_orders``' orders): the cells that left,
    and the step every survivor trained again (1-based), the same at every stage."""
    kept = [o for o in orders.values() if not o.drop]
    assert kept and kept[0].redo_step is not None, "a cell-wise departure keeps some cells"
    step = kept[0].redo_step + 1
    return MembershipChange(step=step, epoch=epoch, members=list(kept[0].members),
                            cells_left=[[k, r] for k, r in sorted(lost)], reason=reason,
                            at=at, stage_steps=[step] * stages)


def group_orders(reports: Mapping[int, RegroupReport], stage: int, members: list[int],
                 epoch: int) -> dict[tuple[int, int], RegroupOrder]:
    """The orders of one stage group's members (``reports`` by replica, one from each): the
    operation a member committed is committed by all; one nobody committed is done again."""
    committed = max((rep.synced_step for rep in reports.values()), default=-1)
    orders = {}
    for r, rep in reports.items():
        commit = rep.op_step <= committed
        if commit and not rep.finished:
            raise RegroupConflict(
                f"stage {stage} replica {r} had not finished the synchronisation of step "
                f"{rep.op_step} that another replica committed")
        orders[(stage, r)] = RegroupOrder(epoch, members, commit=commit)
    return orders


def departure(reports: Mapping[tuple[int, int], RegroupReport],
              orders: Mapping[tuple[int, int], RegroupOrder], stages: int, before: list[int],
              survivors: list[int], epoch: int, reason: str = "",
              at: float | None = None) -> MembershipChange:
    """The record of a decided round: who left, and by stage the first step trained without
    them (1-based, as steps are counted in reports: the step of the broken operation, or the
    one after it where the group committed it; under swarm wiring the step every survivor
    trained again). Where nobody left, a group whose ring held reported nothing: it takes the
    change's step."""

    def without(s: int, r: int, rep: RegroupReport) -> int:
        order = orders[(s, r)]
        return 1 + (order.redo_step if order.redo_step is not None
                    else rep.op_step + order.commit)

    by_stage = [[without(s, r, rep) for (k, r), rep in reports.items()
                 if k == s and r in survivors] for s in range(stages)]
    first = min(min(v) for v in by_stage if v)
    steps = [min(v) if v else first for v in by_stage]
    return MembershipChange(step=first, epoch=epoch, members=survivors,
                            left=[r for r in before if r not in survivors], reason=reason,
                            at=at, stage_steps=steps)


for _conv in (converter, lenient_converter):
    # (a change of who trains is the JSON it always was: no null move beside it)
    _conv.register_unstructure_hook(MembershipChange, make_dict_unstructure_fn(
        MembershipChange, _conv, moved=override(omit_if_default=True),
        cells_left=override(omit_if_default=True)))
    # (an order's JSON is as it was, but for a cell-wise departure's)
    _conv.register_unstructure_hook(RegroupOrder, make_dict_unstructure_fn(
        RegroupOrder, _conv, layout=override(omit_if_default=True)))
