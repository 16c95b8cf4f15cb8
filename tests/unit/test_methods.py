"""Methods as plugins: the registries (``config/methods.py``), the sync algorithms behind
``GroupSync``, the one cadence rule, and a ``ReplicaGroup`` apart from any stage (a fake
algorithm stands in for the ring; the process-level replica tests keep the real one)."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import get_args

import attrs
import numpy as np
import pytest
import torch

from swarm_core.config import methods
from swarm_core.config.schemas import (
    ModelConfig,
    SyncConfig,
    SyncMode,
    TrainingConfig,
    parse_compression,
)
from swarm_core.contract.membership import RegroupOrder, RegroupReport
from swarm_core.pipeline.codecs import Codec
from swarm_core.pipeline.replica_group import ReplicaGroup, StageDropped
from swarm_core.pipeline.ring import RingBroken
from swarm_core.pipeline.stage import StageSpec
from swarm_core.pipeline.syncs import GroupSync, make_sync
from swarm_core.pipeline.syncs.demo import DeMo
from swarm_core.pipeline.syncs.diloco import OuterStep
from swarm_core.pipeline.syncs.dp import GradientAverage
from swarm_core.pipeline.syncs.sparseloco import SparseLoCo
from swarm_core.pipeline.transport import Liveness
from swarm_core.schema import structure

REPO = Path(__file__).resolve().parents[2]


# the registries ---------------------------------------------------------------------------------
def test_every_sync_mode_is_registered_and_builds_its_algorithm():
    assert set(get_args(SyncMode)) == set(methods.SYNC_METHODS)
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    built = {}
    for mode in methods.SYNC_METHODS:
        tc = structure({"steps": 4, "sync": {"mode": mode, "inner_steps": 2}}, TrainingConfig)
        sync = make_sync(tc, params, None, None, 0, 1, torch.device("cpu"))
        assert isinstance(sync, GroupSync)
        built[mode] = type(sync)
        sync.close()
    assert built == {"dp": GradientAverage, "diloco": OuterStep, "sparseloco": SparseLoCo,
                     "demo": DeMo}


def test_element_codecs_have_one_wire_id_each_and_the_frame_codec_names_them():
    coded = {**methods.ELEMENTS, **methods.ROTATED}  # (the rotated codes: their own frames)
    ids = [e.wire_id for e in coded.values()]
    assert len(set(ids)) == len(ids) == len(methods.ELEMENTS) + len(methods.ROTATED)
    assert {c.name.lower(): int(c) for c in Codec} == {
        name: e.wire_id for name, e in coded.items()}


def test_every_boundary_grammar_parses_and_the_docs_table_lists_it():
    docs = (REPO / "docs" / "configs.md").read_text()
    for form in methods.BOUNDARY_FORMS:
        spec = form.grammar.replace("dimK", "dim8").replace("_kK", "_k8").replace("_bB", "_b4")
        # (a subspace spec refuses a bottleneck width beside it)
        c = parse_compression(spec, bottleneck_dim=None if spec.startswith("subspace") else 8,
                              d_model=32)
        assert c.spec == spec
        assert f"| `{form.grammar}` |" in docs, f"docs/configs.md misses {form.grammar}"
    assert set(methods.sync_compressions()) >= {"none", "fp16", "bf16", "int8", "int8_bB",
                                                "fp8", "fp8_bB"}
    for form in methods.sync_compressions():
        structure({"compression": form.replace("_bB", "_b64")}, SyncConfig)


# the cadence ------------------------------------------------------------------------------------
def test_one_cadence_rule():
    dp = SyncConfig()
    diloco = SyncConfig(mode="diloco", inner_steps=3, overlap_steps=1)
    assert [s for s in range(1, 9) if dp.syncs_after(s, 8)] == list(range(1, 9))
    assert [s for s in range(1, 9) if diloco.syncs_after(s, 8)] == [3, 6, 8]
    assert [dp.next_sync(s) for s in range(4)] == [1, 2, 3, 4]
    # (0-based steps 2 and 5 end in an outer step: the first one after each step)
    assert [diloco.next_sync(s) for s in range(6)] == [2, 2, 5, 5, 5, 8]
    assert (dp.period, dp.lag, diloco.period, diloco.lag) == (1, 0, 3, 1)
    assert (dp.drifts(2), diloco.drifts(1), diloco.drifts(2)) == (False, False, True)


def test_no_sync_type_is_tested_and_the_cadence_is_written_once():
    """Nothing outside the registry asks which algorithm runs (``isinstance``, a mode's
    name compared), and only SyncConfig counts steps between syncs."""
    code = {p: p.read_text() for p in (REPO / "swarm_core").rglob("*.py")}
    for path, text in code.items():
        assert not re.search(r"isinstance\([^)]*(OuterStep|GradientAverage|GroupSync)", text), path
        if path.name != "schemas.py":
            assert not re.search(r"%\s*\w*\.?inner_steps|inner_steps\s*-", text), path
        if path.parts[-2] not in ("config",):
            assert not re.search(r"mode\s*==\s*\"(dp|diloco)\"", text), path


# a replica group apart from a stage ---------------------------------------------------------------
class FakeSync(GroupSync):
    """An algorithm whose ring breaks as told, and which records what the group asks of it."""

    def __init__(self, breaks: list[bool]) -> None:
        self.breaks = breaks  # each operation: whether its ring breaks (with it finished)
        self.calls: list[str] = []
        self.rank_n = (0, 0)

    @property
    def max_payload(self) -> int:
        return 64

    def expected_bytes(self) -> int:
        return 0

    def rewire(self, send, recv, rank, replicas) -> None:
        self.calls.append("rewire")
        self.rank_n = (rank, replicas)

    def commit(self) -> None:
        self.calls.append("commit")

    def after_backward(self, step, timeout):
        self.calls.append(f"op{step}")
        if self.breaks and self.breaks.pop(0):
            raise RingBroken(step, True, ConnectionResetError("gone"))
        return (10, 0.5)


def _group(replica: int = 0, replicas: int = 2, order: RegroupOrder | None = None,
           ) -> tuple[ReplicaGroup, list[RegroupReport]]:
    mc = ModelConfig(d_model=8, n_layers=1, n_heads=2, seq_len=4)
    spec = StageSpec(job_id="j", key="k", stage=0, num_stages=1, layers=(0, 1),
                     downstream_addr=None, model=mc, training=TrainingConfig(steps=4),
                     replica=replica, replicas=replicas,
                     group_addrs=(None,) * replicas, group_local=(True,) * replicas)
    module = torch.nn.Linear(2, 2)
    group = ReplicaGroup(spec, module, torch.optim.SGD(module.parameters(), lr=0.1), None,
                         threading.Event(), Liveness(60.0), lambda: None)  # type: ignore[arg-type]
    reports: list[RegroupReport] = []

    def coordinator(report: RegroupReport) -> RegroupOrder:
        reports.append(report)
        assert order is not None
        return order

    group.coordinator = coordinator
    return group, reports


def test_a_broken_ring_regroups_and_commits_what_the_order_says():
    group, reports = _group(order=RegroupOrder(epoch=1, members=[0], commit=True))
    sync = FakeSync([True])
    group.sync = sync
    assert group.before_step(3, False) == (0, 0.0)
    assert reports[0].op_step == 3 and reports[0].finished and reports[0].epoch == 0
    assert sync.calls == ["op3", "rewire", "rewire", "commit"]
    assert (group.epoch, group.members, group.synced_step, sync.rank_n) == (1, [0], 3, (0, 1))
    assert group.leads


def test_a_broken_ring_without_commit_does_the_operation_again():
    group, _ = _group(order=RegroupOrder(epoch=1, members=[0]))
    sync = FakeSync([True, False])
    group.sync = sync
    assert group.before_step(5, False) == (10, 0.5)
    assert sync.calls == ["op5", "rewire", "rewire", "op5"]
    assert group.synced_step == 5


def test_a_dropped_member_ends_its_cell():
    group, _ = _group(replica=1, order=RegroupOrder(epoch=1, members=[0]))
    group.sync = FakeSync([True])
    with pytest.raises(StageDropped, match="replica 1 left the job at step 2"):
        group.before_step(2, False)


def test_without_a_coordinator_a_broken_ring_fails_with_its_cause():
    group, _ = _group()
    group.coordinator = None
    group.sync = FakeSync([True])
    with pytest.raises(ConnectionResetError):
        group.before_step(0, False)


def test_the_word_proposed_is_the_newest_join_told_only_where_the_chain_heard():
    group, _ = _group()
    sync = FakeSync([])
    group.sync = sync
    group.inbox = [(RegroupOrder(epoch=3, members=[0, 1, 2], donor=0), None)]
    group.before_step(0, heard=False)
    assert sync.word == 0.0
    group.before_step(1, heard=True)
    assert sync.word == 3.0
    sync.heard = 3.0  # (the group agreed on it at the confirmation)
    group.before_step(2, heard=True)
    assert group.admit_after == 3


def test_a_dilocos_state_goes_to_its_checkpoint_and_to_a_joiner():
    tc = structure({"steps": 4, "sync": {"mode": "diloco", "inner_steps": 2,
                                         "outer_momentum": 0.9}}, TrainingConfig)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    sync = make_sync(tc, params, None, None, 0, 1, torch.device("cpu"))
    with torch.no_grad():
        for p in params:
            p.sub_(0.1)
    sync.after_step(1, False, 1.0)  # (an outer step over a group of one)
    state = sync.checkpoint_state(["a", "b"])
    assert set(state) == {"a.outer_momentum", "b.outer_momentum"} and sync.own_state
    other = make_sync(tc, [torch.nn.Parameter(torch.zeros(3)),
                           torch.nn.Parameter(torch.zeros(2, 2))], None, None, 0, 1,
                      torch.device("cpu"))
    other.restore_state(["a", "b"], state)
    assert all(np.array_equal(state[k], v) for k, v in other.checkpoint_state(["a", "b"]).items())
    other.take_handoff(sync.handoff())
    assert all(np.array_equal(a, b) for a, b in zip(other.handoff().values(),
                                                     sync.handoff().values(), strict=True))
    dp = make_sync(attrs.evolve(tc, sync=SyncConfig()), params, None, None, 0, 1,
                   torch.device("cpu"))
    assert (dp.checkpoint_state(["a", "b"]), dp.handoff(), dp.own_state) == ({}, {}, False)
    for s in (sync, other, dp):
        s.close()
