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
a survivor and counted once.

Torch-free: the leader decides with it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import attrs

from swarm_core.contract.placement import Placement
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
        MembershipChange, _conv, moved=override(omit_if_default=True)))
