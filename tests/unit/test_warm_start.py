"""``training.warm_start``: a job from another job's checkpoint weights. The leader's submit
rules and checkpoint route, the fellow's fetch and union of the source's stage shards, and a
warm-started pipeline against a single process that loads the same weights."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import orjson
import pytest
import torch

from swarm_core.artifacts.shards import (
    ShardError,
    build_manifest,
    npz_bytes,
    state_arrays,
    weights_from_checkpoint,
)
from swarm_core.client import ApiError
from swarm_core.config.schemas import ModelConfig, TrainingConfig, WarmStart
from swarm_core.contract import RegroupOrder, chain_starts
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.fellow.jobs import JobContext, JobRefused, Progress
from swarm_core.fellow.train import TrainJob
from swarm_core.fellow.warm import warm_weights
from swarm_core.leader import LeaderConfig, create_app
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.model import StageModule, lm_loss, stage_state_names
from swarm_core.pipeline.optim import clip_scale, lr_at, make_optimizer, scale_grads, set_lr
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import ResumeError, own_part
from swarm_core.pipeline.whole import ExperimentModel
from swarm_core.protocol import SESSION_HEADER
from swarm_core.schema import SchemaError, structure
from swarm_tui.commands.argtypes import warm_start
from tests.api_support import A, expect_error, expect_ok, get_job, register
from tests.support import AUTH, TOKEN

MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}
VOCAB = 256  # the byte tokenizer's


def _stage_shards(stages: Sequence[torch.nn.Module], job_id: str, step: int,
                  model: dict[str, Any] = MODEL) -> list[tuple[dict[str, Any], bytes]]:
    """Each stage module's checkpoint shard, (manifest, weights.npz), as a fellow pushes it."""
    out = []
    for k, module in enumerate(stages):
        arrays = state_arrays(module)
        weights = npz_bytes(arrays)
        manifest = build_manifest(job_id=job_id, stage=k, num_stages=len(stages),
                                  fellow_id=k, fellow_name=f"f{k}", layers=(k, k + 1),
                                  step=step, model=model, seed=0, vocab_size=VOCAB,
                                  tokenizer={"name": "byte"}, arrays=arrays, weights=weights)
        out.append((manifest, weights))
    return out


def _fetcher(shards: dict[tuple[str, int, int], tuple[dict[str, Any], bytes]]):
    async def fetch(job_id: str, step: int, stage: int) -> tuple[dict[str, Any], bytes]:
        return shards[(job_id, step, stage)]

    return fetch


# --- config and CLI -----------------------------------------------------------------------------


def test_the_field_is_checked_where_it_comes_in():
    t = structure({"warm_start": {"job_id": "job-000012", "step": 2000}}, TrainingConfig)
    assert t.warm_start == WarmStart("job-000012", 2000)
    assert structure({"warm_start": {"job_id": "job-000012"}}, TrainingConfig) \
        .warm_start == WarmStart("job-000012", None)
    for bad, field in (({"job_id": "../job-1"}, "$.warm_start.job_id"),
                       ({"job_id": "job-000012", "step": 0}, "$.warm_start.step"),
                       ({"job_id": "job-000012", "steps": 3}, "$.warm_start")):
        with pytest.raises(SchemaError) as exc:
            structure({"warm_start": bad}, TrainingConfig)
        assert (exc.value.field or "").startswith(field), exc.value


def test_the_cli_flag_parses_job_and_step():
    assert warm_start("job-000012:2000") == {"job_id": "job-000012", "step": 2000}
    assert warm_start("job-000012") == {"job_id": "job-000012"}
    for bad in ("job-12", "job-000012:", "job-000012:0", "job-000012:x", ":5", ""):
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            warm_start(bad)
        assert "\n" not in str(exc.value)


def test_swarm_submit_sends_the_flag_and_refuses_a_bad_one_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    from types import SimpleNamespace

    from swarm_tui.cli import run
    from swarm_tui.commands import jobs
    from swarm_tui.commands.base import ExitCode

    model = tmp_path / "m.json"
    model.write_text(orjson.dumps(MODEL).decode())
    sent = []

    class Client:
        async def submit(self, req):
            sent.append(req)
            return SimpleNamespace(job_id="job-000002", state="PENDING", waiting_for="")

    monkeypatch.setattr(jobs, "run_with_client",
                        lambda _args, body: asyncio.run(body(Client())))
    argv = ["--leader-url", "http://127.0.0.1:9", "submit", "--model", str(model)]
    assert run([*argv, "--warm-start", "job-000012:2000"]) == 0
    assert sent[0].training.warm_start == WarmStart("job-000012", 2000)
    capsys.readouterr()
    for bad in ("job-12", "job-000012:0"):
        with pytest.raises(SystemExit) as exc:
            run([*argv, "--warm-start", bad])
        assert exc.value.code == ExitCode.USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--warm-start" in err[0], err
    assert run(["--leader-url", "http://127.0.0.1:9", "submit", "--warm-start",
                "job-000012"]) == ExitCode.USAGE  # (a smoke job has no weights)
    assert len(sent) == 1


# --- the leader -------------------------------------------------------------------------------


async def _fellows(client, n: int) -> list[dict[str, Any]]:
    return [await register(client, f"f{i}", data_addr=f"127.0.0.1:{9100 + i}") for i in range(n)]


def _form(manifest: dict[str, Any], weights: bytes) -> aiohttp.MultipartWriter:
    mp = aiohttp.MultipartWriter("form-data")
    for name, body in (("manifest", orjson.dumps(manifest)), ("weights", weights)):
        mp.append(body).set_content_disposition("form-data", name=name)
    return mp


def _train_job(**training: Any) -> dict[str, Any]:
    return {"name": "t", "kind": "train", "model": MODEL,
            "training": {"steps": 4, **training}, "topology": {"fellows": 2}}


@pytest.fixture
async def source(aiohttp_client, tmp_path: Path):
    """A leader with three fellows and a CANCELLED 2-stage job whose checkpoints at steps 2
    and 4 are complete (every stage pushed), and stage 0 alone at step 3: (client, fellows,
    the job's id, the weights pushed by (step, stage))."""
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05)
    client = await aiohttp_client(create_app(cfg))
    fellows = await _fellows(client, 3)
    job = await expect_ok(await client.post(f"{A}/jobs", json=_train_job(), headers=AUTH), 201)
    assert job["state"] == "RUNNING"
    cfg_model = ModelConfig(**MODEL)
    modules = [StageModule(cfg_model, VOCAB, 0, k, k + 1, k, 2) for k in range(2)]
    pushed = {}
    for step, stages in ((2, (0, 1)), (3, (0,)), (4, (0, 1))):
        with torch.no_grad():  # (each step's weights its own)
            for m in modules:
                next(m.parameters()).add_(1.0)
        shards = _stage_shards(modules, job["job_id"], step)
        for k in stages:
            fid = job["placement"]["stages"][k]["fellow_id"]
            f = next(f for f in fellows if f["fellow_id"] == fid)
            resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/{k}",
                                     data=_form(*shards[k]), headers=f["headers"])
            assert resp.status == 201, await resp.text()
            pushed[(step, k)] = shards[k]
    await expect_ok(await client.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH))
    return client, fellows, job["job_id"], pushed


async def _job_count(client) -> int:
    return (await expect_ok(await client.get(f"{A}/jobs", headers=AUTH)))["total"]


@pytest.mark.parametrize("warm, model, needle", [
    ({"job_id": "job-999999"}, MODEL, "no job 'job-999999'"),
    ({"job_id": "SRC", "step": 3}, MODEL, "no complete checkpoint at step 3 (it has: 2, 4)"),
    ({"job_id": "SRC", "step": 6}, MODEL, "no complete checkpoint at step 6"),
    ({"job_id": "SRC"}, {**MODEL, "n_layers": 3}, "model differs in n_layers 2 vs 3"),
    ({"job_id": "SRC"}, {**MODEL, "wire_dtype": "bf16"}, "wire_dtype 'fp32' vs 'bf16'"),
])
async def test_a_warm_start_the_leader_cannot_serve_is_refused_and_nothing_queued(
        source, warm, model, needle):
    client, _fellows, src, _ = source
    before = await _job_count(client)
    body = {**_train_job(warm_start={**warm, "job_id": warm["job_id"].replace("SRC", src)}),
            "model": model}
    err = await expect_error(await client.post(f"{A}/jobs", json=body, headers=AUTH), 400,
                             field="$.training.warm_start")
    assert needle in err["message"] and "\n" not in err["message"], err
    assert await _job_count(client) == before


async def test_a_running_or_smoke_source_is_refused(aiohttp_client, tmp_path):
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05)
    client = await aiohttp_client(create_app(cfg))
    await _fellows(client, 2)
    smoke = await expect_ok(await client.post(f"{A}/jobs", json={"kind": "smoke"},
                                              headers=AUTH), 201)
    running = await expect_ok(await client.post(f"{A}/jobs", json=_train_job(), headers=AUTH),
                              201)
    for src, needle in ((smoke["job_id"], "smoke job"),
                        (running["job_id"], "once it has ended")):
        body = _train_job(warm_start={"job_id": src})
        err = await expect_error(await client.post(f"{A}/jobs", json=body, headers=AUTH), 400,
                                 field="$.training.warm_start")
        assert needle in err["message"], err


async def test_the_newest_step_is_resolved_and_only_its_fellows_fetch_it(source, monkeypatch,
                                                                         capsys):
    client, fellows, src, pushed = source
    body = _train_job(warm_start={"job_id": src})
    job = await expect_ok(await client.post(f"{A}/jobs", json=body, headers=AUTH), 201)
    assert job["training"]["warm_start"] == {"job_id": src, "step": 4}, "newest, resolved"
    assert (await get_job(client, job["job_id"]))["training"]["warm_start"]["step"] == 4
    assert job["state"] == "RUNNING"
    mine = {s["fellow_id"] for s in job["placement"]["stages"]}
    inside = [f for f in fellows if f["fellow_id"] in mine]
    outside = [f for f in fellows if f["fellow_id"] not in mine]
    assert len(inside) == 2 and len(outside) == 1
    base = f"{A}/jobs/{src}/checkpoints"
    for f in inside:  # (every stage of the source, whichever stage it holds)
        for k in (0, 1):
            got = await client.get(f"{base}/4/{k}/weights", headers=f["headers"])
            assert got.status == 200 and await got.read() == pushed[(4, k)][1]
            m = await expect_ok(await client.get(f"{base}/4/{k}/manifest",
                                                 headers=f["headers"]))
            assert (m["step"], m["stage"]) == (4, k)
    # (a fellow that held stage 0 of the source fetched it as a resume would while the
    # source ran: not once it ended, but for the weights a warm start takes)
    held0 = {s["fellow_id"] for s in (await get_job(client, src))["placement"]["stages"]
             if s["stage"] == 0}
    for f in fellows:
        if f["fellow_id"] in held0:
            err = await expect_error(await client.get(f"{base}/4/0/optimizer",
                                                      headers=f["headers"]), 403,
                                     code="wrong_fellow")
            assert f"({src} is CANCELLED)" in err["message"], err
    stranger = next(f for f in outside if f["fellow_id"] not in held0)
    warm = next(f for f in inside if f["fellow_id"] not in held0)
    refused = [(f"{base}/4/0/weights", stranger),  # no cell of the warm job
               (f"{base}/2/0/weights", warm),  # not the step it warm-starts from
               (f"{base}/4/0/optimizer", warm)]  # weights only, never the moments
    for url, f in refused:
        await expect_error(await client.get(url, headers=f["headers"]), 403,
                           code="wrong_fellow")
    # The fellow's own client and fetch: the union of both stages, as pushed.
    from swarm_core.client import SwarmClient

    sc = SwarmClient(str(client.server.make_url("")).rstrip("/"), TOKEN)
    session = inside[0]["session"]
    try:
        async def fetch(job_id: str, step: int, stage: int):
            manifest, weights, optimizer = await sc.checkpoint(job_id, step, stage, session,
                                                               weights_only=True)
            assert optimizer is None
            return manifest, weights

        union = await warm_weights(fetch, src, 4)
        # (and swarm job says where the job's weights came from)
        from swarm_tui.commands import jobs

        bodies: list[Any] = []
        monkeypatch.setattr(jobs, "run_with_client", lambda _a, body: bodies.append(body))
        jobs.cmd_job(argparse.Namespace(job_id=job["job_id"], format="table"))
        capsys.readouterr()
        await bodies[0](sc)
        assert f"{src} step 4 (its weights; fresh optimiser and schedule)" in \
            capsys.readouterr().out
    finally:
        await sc.close()
    want = {}
    for k in (0, 1):
        want.update(weights_from_checkpoint(*pushed[(4, k)]))
    assert union.keys() == want.keys()
    assert all(torch.equal(union[n], want[n]) for n in want)


async def test_a_restarted_leader_keeps_the_resolved_step_and_who_may_fetch_it(
        source, aiohttp_client, tmp_path):
    """The step resolved at submit is part of the stored job: a leader restarted on the same
    state still names it, and still serves it to the warm job's fellows alone."""
    client, fellows, src, pushed = source
    job = await expect_ok(await client.post(f"{A}/jobs", json=_train_job(
        warm_start={"job_id": src}), headers=AUTH), 201)
    mine = {s["fellow_id"] for s in job["placement"]["stages"]}
    await client.close()
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05)
    again = await aiohttp_client(create_app(cfg))
    view = await get_job(again, job["job_id"])
    assert view["training"]["warm_start"] == {"job_id": src, "step": 4}
    base = f"{A}/jobs/{src}/checkpoints/4/1/weights"
    for f in fellows:  # (each registers again, as the same process, under a new session)
        back = await expect_ok(await again.post(f"{A}/fellows/register", json=f["body"],
                                                headers=AUTH), 201)
        assert back["fellow_id"] == f["fellow_id"]
        got = await again.get(base, headers={**AUTH, SESSION_HEADER: back["session"]})
        if f["fellow_id"] in mine:
            assert got.status == 200 and await got.read() == pushed[(4, 1)][1]
        else:
            assert got.status == 403, await got.text()


def test_a_learned_boundary_needs_the_split_and_a_subspace_the_seed():
    from swarm_core.contract import JobSubmit
    from swarm_core.contract.job import warm_split_mismatch as _warm_split_mismatch

    def job(compression: str, stages: int, seed: int = 0, **training: Any) -> JobSubmit:
        return structure({"kind": "train", "model": {**MODEL, "n_layers": 4,
                                                     "compression": compression},
                          "training": {"seed": seed, **training},
                          "topology": {"stages": stages}}, JobSubmit)

    learned = job("learned_dim8", 2)
    assert _warm_split_mismatch(learned, job("learned_dim8", 2, seed=3), "job-000001") is None
    why = _warm_split_mismatch(learned, job("learned_dim8", 4), "job-000001")
    assert why is not None and "learned_dim8 learns its boundaries where job-000001's" in why
    why = _warm_split_mismatch(learned, job("learned_dim8", 2, stage_weights=[1, 3]), "job-1")
    assert why is not None and "[(0, 1), (1, 4)], this job's [(0, 2), (2, 4)]" in why
    assert _warm_split_mismatch(job("none", 2), job("none", 4), "job-000001") is None
    sub = job("subspace_k8", 2, seed=1)
    assert _warm_split_mismatch(sub, job("subspace_k8", 1, seed=1), "job-000001") is None
    why = _warm_split_mismatch(sub, job("subspace_k8", 1, seed=2), "job-000001")
    assert why is not None and "seed 2, this job's 1" in why


async def test_a_step_named_is_kept(source):
    client, _fellows, src, _ = source
    body = _train_job(warm_start={"job_id": src, "step": 2})
    job = await expect_ok(await client.post(f"{A}/jobs", json=body, headers=AUTH), 201)
    assert job["training"]["warm_start"] == {"job_id": src, "step": 2}


# --- the fellow: fetch, union, its own part -----------------------------------------------------


def _whole(ranges: Sequence[tuple[int, int]] | None = None, seed: int = 3) -> ExperimentModel:
    return ExperimentModel(ModelConfig(**MODEL), VOCAB, seed, ranges)


async def test_the_union_of_another_splits_shards_is_the_glued_model():
    model = _whole([(0, 1), (1, 2)])
    shards = _stage_shards(list(model.stages), "job-000007", 5)
    fetch = _fetcher({("job-000007", 5, k): s for k, s in enumerate(shards)})
    union = await warm_weights(fetch, "job-000007", 5)
    flat = model.flat_state_dict()
    assert union.keys() == flat.keys()
    assert all(torch.equal(union[n], flat[n]) for n in flat)
    whole = StageModule(ModelConfig(**MODEL), VOCAB, 0, 0, 2, 0, 1)
    whole.load_state_dict(own_part(whole, union), strict=True)  # (one stage takes it all)


async def test_a_cell_fetches_only_the_shards_that_hold_its_names():
    """Each shard's manifest lists its names: a cell reads every manifest and fetches the
    weights of the source stages that hold what it takes, no others; a manifest that lists
    no names has its shard fetched (a leader's shards from before the list)."""
    cfg = {**MODEL, "n_layers": 4}
    model = ExperimentModel(ModelConfig(**cfg), VOCAB, 3, [(0, 1), (1, 2), (2, 3), (3, 4)])
    shards = _stage_shards(list(model.stages), "job-000007", 5, model=cfg)
    flat = model.flat_state_dict()
    listed: list[int] = []
    fetched: list[int] = []
    unlisted: set[int] = set()

    async def fetch(job_id: str, step: int, stage: int):
        fetched.append(stage)
        return shards[stage]

    async def manifest(job_id: str, step: int, stage: int):
        listed.append(stage)
        m = shards[stage][0]
        return {k: v for k, v in m.items() if k != "params"} if stage in unlisted else m

    for (a, b, stage, stages), want in [((2, 4, 1, 2), [2, 3]), ((0, 2, 0, 2), [0, 1]),
                                        ((0, 4, 0, 1), [0, 1, 2, 3]), ((3, 4, 2, 3), [3])]:
        listed.clear()
        fetched.clear()
        names = stage_state_names(ModelConfig(**cfg), a, b, stage, stages)
        union = await warm_weights(fetch, "job-000007", 5, names, manifest)
        assert (listed, fetched) == ([0, 1, 2, 3], want)
        cell = StageModule(ModelConfig(**cfg), VOCAB, 0, a, b, stage, stages)
        assert set(cell.state_dict()) == names
        cell.load_state_dict(own_part(cell, union), strict=True)
        assert all(torch.equal(t, flat[n]) for n, t in cell.state_dict().items())
    unlisted.add(0)
    fetched.clear()
    await warm_weights(fetch, "job-000007", 5,
                       stage_state_names(ModelConfig(**cfg), 2, 4, 1, 2), manifest)
    assert fetched == [0, 2, 3]


async def test_a_shard_that_is_not_the_one_asked_for_is_refused():
    shards = _stage_shards(list(_whole([(0, 1), (1, 2)]).stages), "job-000007", 5)
    wrong_step = {**shards[1][0], "step": 4}
    fetch = _fetcher({("job-000007", 5, 0): shards[0],
                      ("job-000007", 5, 1): (wrong_step, shards[1][1])})
    with pytest.raises(ShardError, match="manifest says job-000007 step 4 stage 1 of 2"):
        await warm_weights(fetch, "job-000007", 5)
    tampered = _fetcher({("job-000007", 5, 0): (shards[0][0], shards[1][1])})
    with pytest.raises(ShardError, match="sha256"):
        await warm_weights(tampered, "job-000007", 5)


def test_a_stage_missing_from_the_weights_is_named():
    stage1 = StageModule(ModelConfig(**MODEL), VOCAB, 0, 1, 2, 1, 2)
    state = {k: v for k, v in stage1.state_dict().items() if not k.startswith("head.")}
    with pytest.raises(ResumeError, match=r"the weights hold no 'head\.[a-z_.]+' \(and "):
        own_part(stage1, state)


def test_tied_weights_take_one_tensor_or_refuse():
    tied = StageModule(ModelConfig(**MODEL, tie_weights=True), VOCAB, 0, 0, 2, 0, 1)
    assert tied.tied
    untied = _whole([(0, 1), (1, 2)]).flat_state_dict()  # (a split source trains them apart)
    with pytest.raises(ResumeError, match="one tied tensor"):
        own_part(tied, untied)
    same = dict(untied, **{"head.lm_head.weight": untied["embed.tok.weight"]})
    tied.load_state_dict(own_part(tied, same), strict=True)


def _start(training: dict[str, Any], stage: int = 0, stages: int = 2, **kw: Any):
    start = chain_starts(ModelConfig(**MODEL), structure(training, TrainingConfig),
                         [f"127.0.0.1:{9200 + k}" for k in range(stages)],
                         job_id="job-000009")[stage]
    return attrs.evolve(start, **kw)


async def _report(_upd: Any) -> None:
    pass


def _order() -> RegroupOrder:
    return RegroupOrder(epoch=1, members=[0, 1], donor=0)


PRUNED = "cannot warm-start from job-000007 step 5: no checkpoint of stage 0 at step 5"


async def _pruned(job_id: str, step: int, stage: int) -> Any:
    raise ApiError(404, "no_checkpoint", f"no checkpoint of stage {stage} at step {step}")


async def _refused(ctx: JobContext, training: dict[str, Any]) -> str:
    """The one line a fresh stage 0 cell is refused with."""
    with pytest.raises(JobRefused) as refused:
        await TrainJob(_start(training), ctx)._prepare()
    return str(refused.value)


async def test_a_fresh_cell_fetches_the_warm_start_and_a_resumed_or_joining_one_does_not():
    model = _whole([(0, 2)])
    shards = {("job-000007", 5, 0): _stage_shards(list(model.stages), "job-000007", 5)[0]}
    asked: list[tuple[str, int, int]] = []

    async def fetch_weights(job_id: str, step: int, stage: int):
        asked.append((job_id, step, stage))
        return shards[(job_id, step, stage)]

    async def fetch_checkpoint(job_id: str, step: int, stage: int):
        asked.append((job_id, step, stage))
        raise RuntimeError("stop here")  # (its own checkpoint: what a resume fetches)

    ctx = JobContext(fellow_id=0, progress=Progress(), report=_report,
                     fetch_weights=fetch_weights, fetch_checkpoint=fetch_checkpoint)
    warm = {"warm_start": {"job_id": "job-000007", "step": 5}}
    job = TrainJob(_start(warm, stage=1), ctx)
    await job._prepare()
    assert asked == [("job-000007", 5, 0)]
    state, optimizer = job._restored()
    assert optimizer is None and state is not None
    assert state.keys() == model.flat_state_dict().keys()

    asked.clear()
    with pytest.raises(RuntimeError, match="stop here"):
        await TrainJob(_start(warm, stage=1, resume_step=2), ctx)._prepare()
    assert asked == [("job-000009", 2, 1)], "a resume takes its own checkpoint"

    asked.clear()
    joiner = TrainJob(_start(warm, stage=1, join=_order()), ctx)
    await joiner._prepare()
    assert asked == [] and joiner._restored() == (None, None), "a joiner takes its group's"

    assert await _refused(attrs.evolve(ctx, fetch_weights=_pruned), warm) == PRUNED


async def test_a_cell_of_another_split_fetches_its_own_stages_weights_alone():
    """Through the fellow's fetches (as the daemon lends them): stage 1 of a two-stage job
    warm-starting from a two-stage source reads both manifests and fetches one shard."""
    model = _whole([(0, 1), (1, 2)])
    shards = _stage_shards(list(model.stages), "job-000007", 5)
    asked: list[tuple[str, int]] = []

    async def fetch_weights(job_id: str, step: int, stage: int):
        asked.append(("weights", stage))
        return shards[stage]

    async def fetch_manifest(job_id: str, step: int, stage: int):
        asked.append(("manifest", stage))
        return shards[stage][0]

    ctx = JobContext(fellow_id=0, progress=Progress(), report=_report,
                     fetch_weights=fetch_weights, fetch_manifest=fetch_manifest)
    warm = {"warm_start": {"job_id": "job-000007", "step": 5}}
    job = TrainJob(_start(warm, stage=1), ctx)
    await job._prepare()
    assert asked == [("manifest", 0), ("manifest", 1), ("weights", 1)]
    state, _ = job._restored()
    assert state is not None and set(state) == set(model.stages[1].state_dict())

    assert await _refused(attrs.evolve(ctx, fetch_manifest=_pruned), warm) == PRUNED


# --- exactness: a warm-started pipeline against one process -------------------------------------


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def _reference_from(state: dict[str, torch.Tensor], tc: TrainingConfig, data) -> list[float]:
    """One process, the whole model in one module: load the weights, then train from step 0
    with a fresh AdamW and the schedule from its start (warmup included)."""
    mc = ModelConfig(**MODEL)
    torch.manual_seed(1234)  # (an init that the load must overwrite, not the job's)
    model = StageModule(mc, VOCAB, 99, 0, mc.n_layers, 0, 1)
    model.load_state_dict(state, strict=True)
    opt = make_optimizer(model, tc)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step in range(tc.steps):
        set_lr(opt, lr_at(step, tc))
        x, y = data.batch(step, tc.batch_size, mc.seq_len, tc.seed)
        total = 0.0
        for xs, ys in zip(x.chunk(tc.micro_batches), y.chunk(tc.micro_batches), strict=True):
            loss = lm_loss(model(xs), ys) / tc.micro_batches
            total += float(loss.detach())
            loss.backward()
        sq = sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None)
        scale_grads(params, clip_scale(sq, tc.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _step_losses(res: dict[int, Any], stages: int, replicas: int) -> list[float]:
    """The step's loss: the mean of each replica's last stage's (each over an equal share)."""
    per_replica = [res[r * stages + stages - 1].losses for r in range(replicas)]
    return [sum(step) / replicas for step in zip(*per_replica, strict=True)]


@pytest.mark.parametrize("source_stages, stages, replicas", [(1, 2, 1), (2, 1, 1),
                                                               (1, 2, 2)])
def test_a_warm_started_pipeline_computes_what_one_process_computes(data, source_stages,
                                                                    stages, replicas):
    mc = ModelConfig(**MODEL)
    trained = TrainingConfig(steps=6, batch_size=8, micro_batches=2, seed=5)
    _, source = train_reference(mc, trained, data,
                                split_layers(mc.n_layers, [1] * source_stages))
    shards = _stage_shards(list(source.stages), "job-000003", 6)
    fetch = _fetcher({("job-000003", 6, k): s for k, s in enumerate(shards)})
    union = asyncio.run(warm_weights(fetch, "job-000003", 6))
    # (a new job: another seed, its own data order; only the weights come from the source)
    tc = TrainingConfig(steps=4, batch_size=8, micro_batches=2, seed=0, eval_batches=1)
    res = run_local_pipeline(mc, tc, data, stages, replicas=replicas, stage_kwargs={
        k: {"initial_state": union, "own_keys": True} for k in range(stages * replicas)})
    got = _step_losses(res, stages, replicas)
    ref = _reference_from(union, tc, data)
    assert len(got) == 4
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5, (ref, got)
    cold = _step_losses(run_local_pipeline(mc, tc, data, stages, replicas=replicas), stages,
                        replicas)
    assert got[0] < cold[0] - 0.1, "the weights were the source's, not the seeded init"


def test_a_stage_the_weights_lack_fails_in_one_line_before_it_trains(data):
    mc = ModelConfig(**MODEL)
    union = _whole([(0, 2)]).flat_state_dict()
    del union["head.ln_f.weight"]
    tc = TrainingConfig(steps=2, batch_size=8, micro_batches=2, eval_batches=1)
    stepped: list[tuple[int, int]] = []
    res = run_local_pipeline(mc, tc, data, 2, stage_kwargs={
        k: {"initial_state": union, "own_keys": True} for k in range(2)},
        on_step=lambda cell, rep: stepped.append((cell, rep.step)))
    assert isinstance(res[1], ResumeError)
    assert str(res[1]) == "the weights hold no 'head.ln_f.weight'"
    assert stepped == []  # (no step of either stage: the weights are checked first)


@pytest.mark.parametrize("sweep, message, field", [
    ({"warm_up": {"steps": 0}}, "must be", "warm_up.steps"),
    ({"warm_up": {"steps": 5}, "overrides": {"warm_start": {"job_id": "job-000001"}}},
     "give warm_up (a warm-up job the sweep trains first) or overrides.warm_start", "warm_up"),
])
def test_a_sweeps_warm_up_is_checked_in_one_line(sweep, message, field):
    from swarm_core.config.profiles import SweepSpec
    from swarm_core.schema import SchemaError, structure

    with pytest.raises(SchemaError) as err:
        structure(sweep, SweepSpec)
    assert message in str(err.value) and field in (err.value.field or "")
    assert "\n" not in str(err.value)
    assert structure({"warm_up": {"steps": 5}}, SweepSpec).warm_up.steps == 5


def test_tied_weights_split_apart_and_another_tokenizer_are_refused():
    from swarm_core.config.schemas import ModelConfig, TrainingConfig, warm_start_mismatch
    from swarm_core.contract import JobSubmit
    from swarm_core.contract.job import warm_split_mismatch

    def job(stages: int) -> JobSubmit:
        return structure({"kind": "train", "model": {**MODEL, "tie_weights": True},
                          "training": {}, "topology": {"stages": stages}}, JobSubmit)

    why = warm_split_mismatch(job(1), job(2), "job-000001")
    assert why is not None and "trained the embedding and the head apart" in why
    assert warm_split_mismatch(job(2), job(1), "job-000001") is None
    model = ModelConfig(**MODEL)
    bpe = structure({"tokenizer": "bpe", "dataset": "shakespeare"}, TrainingConfig)
    other = structure({"tokenizer": "bpe", "dataset": "textfiles",
                       "dataset_paths": ["a.txt"]}, TrainingConfig)
    why = warm_start_mismatch(model, other, model, bpe)
    assert why is not None and "the tokenizer" in why and "textfiles" in why
    assert warm_start_mismatch(model, bpe, model, bpe) is None
    assert "the tokenizer" in (warm_start_mismatch(model, TrainingConfig(), model, bpe) or "")


def test_a_sweeps_warm_up_is_run_zeros_job_made_plain_and_checked_against_every_run(tmp_path):
    from swarm_core.config.profiles import (
        ConfigError,
        load_experiment,
        warm_started,
        warm_up_run,
    )

    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "m.json").write_text(json.dumps({"name": "m", **MODEL}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 4, "batch_size": 4, "micro_batches": 2,
         "sync": {"mode": "diloco", "inner_steps": 2, "compression": "int8", "fragments": 2},
         "cluster_profile": {"stages": 1, "replicas": 2},
         "network_profile": {"name": "slow", "tx_mbps": 5, "rx_mbps": 5}}))

    def config(sweep: dict[str, Any]) -> Path:
        path = tmp_path / "exp.json"
        path.write_text(json.dumps({"name": "w", "training_config": "training/t.json",
                                    "model_configs": ["model/m.json"], "sweep": sweep}))
        return path

    exp = load_experiment(config({"seeds": [0, 1], "warm_up": {"steps": 3}}))
    warm = warm_up_run(exp.runs[0], 3).job("warm-up")
    assert warm.train is not None and warm.train.steps == 3 and warm.train.link is None
    assert (warm.train.sync.mode, warm.train.sync.compression) == ("dp", "none")
    assert exp.runs[0].training["sync"]["mode"] == "diloco"  # (the runs keep their own)
    # `swarm sweep --warm-start`: another sweep's warm-up in place of this one's.
    shared = warm_started(exp, {"job_id": "job-000007", "step": 3})
    assert shared.config.sweep.warm_up is None
    assert shared.config.sweep.overrides["warm_start"] == {"job_id": "job-000007", "step": 3}
    assert [r.job(r.run_name).train.warm_start for r in shared.runs] == \
        [WarmStart("job-000007", 3)] * 2
    assert exp.config.sweep.warm_up is not None and exp.runs[0].training.get("warm_start") is None
    with pytest.raises(ConfigError) as err:
        load_experiment(config({"compressions": ["none", "fixed_int8"],
                                "warm_up": {"steps": 3}}))
    assert err.value.field == "$.sweep.warm_up" and "\n" not in str(err.value)
    assert "run 1" in err.value.message and "compression 'none' vs 'fixed_int8'" \
        in err.value.message
    # (with the warm-up not to be trained, --warm-start's job is the leader's to check)
    assert len(load_experiment(config({"compressions": ["none", "fixed_int8"],
                                       "warm_up": {"steps": 3}}), warm_up=False).runs) == 2
