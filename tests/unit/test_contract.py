"""The job contract end to end: the START a real leader sends is what the fellow reads.

A leader app on a loopback port dispatches train jobs of 1, 2, 3 and 4 stages (fellows with one
device slot, and with several); each stage's START signal is fed to the fellow's own parser and
the stage it describes is checked against the fellows' registrations and the job's placement.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from swarm_core.contract import StageStart
from swarm_core.fellow.daemon import parse_start
from swarm_core.protocol import SESSION_HEADER
from swarm_core.schema import unstructure

A = "/api/v1"
MODEL = {"d_model": 16, "n_layers": 6, "n_heads": 2, "seq_len": 8}


async def _register(api: Any, auth: dict[str, str], i: int, slots: int) -> dict[str, Any]:
    body = {"name": f"f{i}", "instance_id": f"i{i}", "devices": ["cpu"] * slots,
            "data_addrs": [f"127.0.0.1:{9000 + 10 * i + s}" for s in range(slots)]}
    resp = await api.post(f"{A}/fellows/register", json=body, headers=auth)
    assert resp.status == 201, await resp.text()
    reg = await resp.json()
    return {**reg, "addrs": body["data_addrs"],
            "headers": {**auth, SESSION_HEADER: reg["session"]}}


async def _starts(api: Any, fellow: dict[str, Any]) -> list[dict[str, Any]]:
    resp = await api.get(f"{A}/fellows/{fellow['fellow_id']}/signals",
                         params={"after": "0", "wait": "0"}, headers=fellow["headers"])
    return [s["payload"] for s in (await resp.json())["signals"] if s["kind"] == "START"]


@pytest.mark.parametrize("fellows, slots, replicas", [
    (1, 1, 1), (2, 1, 1), (3, 1, 1), (1, 3, 1), (2, 2, 1), (4, 1, 2), (2, 2, 2), (3, 1, 3)])
async def test_the_leaders_start_is_what_each_stage_reads(api, auth, fellows, slots, replicas):
    regs = [await _register(api, auth, i, slots) for i in range(fellows)]
    body = {"name": "contract", "kind": "train", "model": MODEL,
            "topology": {"fellows": fellows, "slots_per_fellow": slots, "replicas": replicas},
            "training": {"steps": 2, "batch_size": 12, "micro_batches": 2}}
    resp = await api.post(f"{A}/jobs", json=body, headers=auth)
    assert resp.status == 201, await resp.text()
    info = await resp.json()
    assert info["state"] == "RUNNING"
    stages = fellows * slots // replicas
    starts: list[StageStart] = [parse_start(p) for r in regs for p in await _starts(api, r)]
    assert sorted((s.stage, s.replica) for s in starts) == sorted(
        (k, r) for k in range(stages) for r in range(replicas)), "one START per cell"
    for r in range(1, replicas):
        # Each replica is a chain of its own: what holds of replica 0 below holds of it too.
        chain = {s.stage: s for s in starts if s.replica == r}
        for k, start in chain.items():
            down = chain.get(k + 1)
            assert start.downstream_addr == (None if down is None else down.mine.data_addr)
    if replicas > 1:
        # The replicas of a stage form a ring: each sends to the next one's address.
        for start in starts:
            nxt = next(s for s in starts if s.stage == start.stage
                       and s.replica == (start.replica + 1) % replicas)
            assert start.ring_next.data_addr == nxt.mine.data_addr
    else:
        assert all(s.ring_next is None for s in starts)
    by_stage = {s.stage: s for s in starts if s.replica == 0}
    # One job key; the placement each stage got is the job's, as the leader reports it.
    assert len({s.key for s in starts}) == 1 and len(starts[0].key) == 32
    assert all(unstructure(s.placement) == info["placement"] for s in starts)
    layers = [by_stage[k].mine.layers.as_tuple() for k in range(stages)]
    assert layers[0][0] == 0 and layers[-1][1] == MODEL["n_layers"]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(layers))
    addr_of = {(r["fellow_id"], s): a for r in regs for s, a in enumerate(r["addrs"])}
    for k, start in by_stage.items():
        mine = start.mine
        assert (start.job_id, start.kind, start.num_stages) == (info["job_id"], "train", stages)
        assert start.model.n_layers == MODEL["n_layers"] and start.train.steps == 2
        assert mine.data_addr == addr_of[(mine.fellow_id, mine.slot)]
        # Stage k dials stage k+1 at the address of the slot that runs it.
        down = by_stage.get(k + 1)
        assert start.downstream_addr == (None if down is None else down.mine.data_addr)
        # Neighbours in one fellow's slots share its machine: their link is local.
        assert start.local_down == (down is not None and down.mine.fellow_id == mine.fellow_id)
        up = by_stage.get(k - 1)
        assert start.local_up == (up is not None and up.mine.fellow_id == mine.fellow_id)
    # Each fellow's slots fill first: with several slots a fellow holds neighbouring stages
    # (of one replica, the replicas one after the other).
    assert [s.mine.fellow_id for s in sorted(starts, key=lambda s: (s.replica, s.stage))] == \
        [r["fellow_id"] for r in regs for _ in range(slots)]


async def test_the_stage_a_start_describes_is_the_pipelines_input(api, auth):
    """The engine's StageSpec is built from the parsed START, nothing else."""
    from swarm_core.pipeline.stage import StageSpec

    regs = [await _register(api, auth, i, 1) for i in range(2)]
    resp = await api.post(f"{A}/jobs", headers=auth, json={
        "kind": "train", "model": MODEL, "topology": {"fellows": 2},
        "training": {"steps": 3, "batch_size": 4, "micro_batches": 2, "threads": 2}})
    assert resp.status == 201, await resp.text()
    (first,) = await _starts(api, regs[0])
    spec = StageSpec.from_start(parse_start(first), threads=1)
    assert (spec.stage, spec.num_stages, spec.layers) == (0, 2, (0, 3))
    assert spec.downstream_addr == regs[1]["addrs"][0]
    assert spec.training.threads == 1 and spec.training.steps == 3  # the fellow's threads
    assert spec.model.d_model == MODEL["d_model"] and not spec.local_down
