"""Stage shards: export on the fellow (npz without pickles) and the leader's push route."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import torch

from swarm_core.artifacts.shards import (
    ShardError,
    build_manifest,
    load_shard,
    npz_bytes,
    optimizer_from_checkpoint,
    state_arrays,
    write_shard,
)
from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.leader import LeaderConfig, create_app
from swarm_core.leader.uploads import OPTIMIZER_SLACK, OPTIMIZER_TIMES
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.optim import (
    OptimizerStateError,
    load_optimizer_arrays,
    make_optimizer,
    optimizer_arrays,
)
from swarm_core.pipeline.whole import ExperimentModel
from swarm_core.protocol import SESSION_HEADER
from tests.support import AUTH, TOKEN

A = "/api/v1"
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}


def _stage_module(stage: int) -> StageModule:
    return StageModule(ModelConfig(**MODEL), 32, 0, stage, stage + 1, stage, 2)


def _trained(stage: int) -> tuple[StageModule, torch.optim.AdamW]:
    """A stage module after two AdamW steps: it has optimiser state."""
    module = _stage_module(stage)
    opt = make_optimizer(module, TrainingConfig())
    for _ in range(2):
        x = torch.randint(0, 32, (2, 8)) if stage == 0 else torch.randn(2, 8, 16)
        module(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return module, opt


def _build(module: StageModule, opt: torch.optim.AdamW | None, stage: int, fellow_id: int,
           job_id: str, step: int) -> tuple[dict[str, Any], bytes, dict[str, np.ndarray],
                                            bytes | None]:
    arrays = state_arrays(module)
    weights = npz_bytes(arrays)
    opt_bytes = npz_bytes(optimizer_arrays(opt, module)) if opt is not None else None
    manifest = build_manifest(job_id=job_id, stage=stage, num_stages=2, fellow_id=fellow_id,
                              fellow_name=f"f{fellow_id}", layers=(stage, stage + 1), step=step,
                              model=MODEL, seed=0, vocab_size=32,
                              tokenizer={"name": "byte"}, arrays=arrays, weights=weights,
                              optimizer=opt_bytes)
    return manifest, weights, arrays, opt_bytes


def _shard(stage: int = 0, fellow_id: int = 0, job_id: str = "job-000001",
           step: int = 4) -> tuple[dict[str, Any], bytes, dict[str, np.ndarray]]:
    """A fresh stage's shard, as exported: weights only."""
    return _build(_stage_module(stage), None, stage, fellow_id, job_id, step)[:3]


def _checkpoint(stage: int, fellow_id: int, job_id: str,
                step: int = 4) -> tuple[dict[str, Any], bytes, bytes]:
    """A trained stage's pushed checkpoint: manifest, weights and optimiser state."""
    manifest, weights, _, opt_bytes = _build(*_trained(stage), stage, fellow_id, job_id, step)
    assert opt_bytes is not None
    return manifest, weights, opt_bytes


def test_optimizer_state_roundtrips_through_npz_exactly():
    module, opt = _trained(1)
    raw = npz_bytes(optimizer_arrays(opt, module))
    manifest = {"optimizer_sha256": hashlib.sha256(raw).hexdigest()}
    arrays = optimizer_from_checkpoint(manifest, raw)
    assert arrays is not None
    assert "blocks.1.attn.qkv.weight.exp_avg_sq" in arrays
    assert "head.lm_head.weight.step" in arrays
    fresh = _stage_module(1)
    fresh.load_state_dict(module.state_dict())
    fresh_opt = make_optimizer(fresh, TrainingConfig())
    load_optimizer_arrays(fresh_opt, fresh, arrays)
    by_name = dict(fresh.named_parameters())
    for name, p in module.named_parameters():
        got, want = fresh_opt.state[by_name[name]], opt.state[p]
        assert set(got) == set(want)
        for field in want:
            assert torch.equal(got[field], want[field]), (name, field)
    # The next step is the same on both.
    for m, o in ((module, opt), (fresh, fresh_opt)):
        m(torch.ones(1, 8, 16)).pow(2).mean().backward()
        o.step()
    for (name, a), b in zip(module.state_dict().items(), fresh.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update({"blocks.9.mlp.0.weight.exp_avg": np.zeros(1)}), "names no parameter"),
    (lambda a: a.update({"blocks.1.ln1.weight.momentum": np.zeros(16)}), "unknown field"),
    (lambda a: a.update({"blocks.1.ln1.weight.exp_avg": np.zeros(3)}), "has shape"),
    (lambda a: a.pop("blocks.1.ln1.weight.exp_avg_sq"), "incomplete"),
])
def test_optimizer_state_that_does_not_fit_is_refused_and_changes_nothing(change, message):
    module, opt = _trained(1)
    arrays = optimizer_arrays(opt, module)
    change(arrays)
    target, target_opt = _trained(1)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in target_opt.state.items()}
    with pytest.raises(OptimizerStateError, match=message):
        load_optimizer_arrays(target_opt, target, arrays)
    after = {id(p): st for p, st in target_opt.state.items()}
    assert before.keys() == after.keys()
    for key, fields in before.items():
        for field, value in fields.items():
            assert torch.equal(after[key][field], value)


def test_checkpoint_optimizer_bytes_must_be_the_ones_the_manifest_names():
    module, opt = _trained(0)
    raw = npz_bytes(optimizer_arrays(opt, module))
    with pytest.raises(ShardError, match="sha256"):
        optimizer_from_checkpoint({"optimizer_sha256": "0" * 64}, raw)
    with pytest.raises(ShardError, match="did not come"):
        optimizer_from_checkpoint({"optimizer_sha256": hashlib.sha256(raw).hexdigest()}, None)
    with pytest.raises(ShardError, match="does not name"):
        optimizer_from_checkpoint({"optimizer_sha256": None}, raw)
    assert optimizer_from_checkpoint({}, None) is None  # a checkpoint from before: no state


def test_shard_roundtrip_without_pickles(tmp_path):
    manifest, weights, arrays = _shard(stage=1, fellow_id=5)
    d = write_shard(tmp_path, manifest, weights)
    assert d.name == "stage-1-fellow-5"
    back, loaded = load_shard(d)
    assert back["layers"] == {"start": 1, "stop": 2} and back["has_head"] is True
    assert set(loaded) == set(arrays) and "blocks.1.attn.qkv.weight" in loaded
    for k in arrays:
        np.testing.assert_array_equal(loaded[k], arrays[k])
    # Plain npz: loads with allow_pickle=False.
    with np.load(d / "weights.npz", allow_pickle=False) as z:
        assert set(z.files) == set(arrays)


def test_stage_shards_union_to_the_whole_model():
    mc = ModelConfig(**MODEL)
    whole = ExperimentModel(mc, 32, 0, [(0, 1), (1, 2)]).flat_state_dict()
    union: dict[str, np.ndarray] = {}
    for s in (0, 1):
        union.update(_shard(stage=s)[2])
    assert set(union) == set(whole)
    for k, v in whole.items():
        assert torch.equal(torch.from_numpy(union[k]), v)


def test_tampered_weights_are_refused(tmp_path):
    manifest, weights, _ = _shard()
    d = write_shard(tmp_path, manifest, weights)
    mid = len(weights) // 2
    (d / "weights.npz").write_bytes(weights[:mid] + bytes([weights[mid] ^ 0xFF]) +
                                    weights[mid + 1:])
    with pytest.raises(ShardError, match="sha256"):
        load_shard(d)
    (d / "weights.npz").unlink()
    with pytest.raises(ShardError, match=r"missing weights\.npz"):
        load_shard(d)


# --- the push route --------------------------------------------------------------------------


async def _leader_and_two_fellows(aiohttp_client, tmp_path: Path):
    """A leader (uploads up to 200 kB) and two fellows registered with it: (client, fellows
    with their session headers, config)."""
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05,
                       max_upload_bytes=200_000)
    client = await aiohttp_client(create_app(cfg))
    fellows = []
    for i in range(2):
        body = {"name": f"f{i}", "instance_id": f"i{i}", "data_addr": f"127.0.0.1:{9000 + i}"}
        resp = await client.post(f"{A}/fellows/register", json=body, headers=AUTH)
        reg = await resp.json()
        fellows.append({**reg, "headers": {**AUTH, SESSION_HEADER: reg["session"]}})
    return client, fellows, cfg


@pytest.fixture
async def leader(aiohttp_client, tmp_path: Path):
    client, fellows, cfg = await _leader_and_two_fellows(aiohttp_client, tmp_path)
    job = {"name": "t", "kind": "train", "model": MODEL, "training": {"steps": 4},
           "topology": {"fellows": 2}}
    resp = await client.post(f"{A}/jobs", json=job, headers=AUTH)
    job = await resp.json()
    assert job["state"] == "RUNNING"
    return client, fellows, job, cfg


def _form(manifest: Any, weights: bytes, order: tuple[str, ...] = ("manifest", "weights"),
          optimizer: bytes | None = None) -> aiohttp.MultipartWriter:
    if optimizer is not None and order == ("manifest", "weights"):
        order = ("manifest", "weights", "optimizer")
    parts = {"manifest": orjson.dumps(manifest), "weights": weights, "optimizer": optimizer}
    mp = aiohttp.MultipartWriter("form-data")
    for name in order:
        part = mp.append(parts[name] or b"")
        part.set_content_disposition("form-data", name=name)
    return mp


def _stage_fellow(job: dict[str, Any], fellows: list[dict[str, Any]], stage: int):
    fid = job["placement"]["stages"][stage]["fellow_id"]
    return next(f for f in fellows if f["fellow_id"] == fid)


async def test_push_shard_stores_it_and_records_a_receipt(leader):
    client, fellows, job, cfg = leader
    f = _stage_fellow(job, fellows, 1)
    manifest, weights, _ = _shard(stage=1, fellow_id=f["fellow_id"], job_id=job["job_id"])
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/1", data=_form(manifest, weights),
                             headers=f["headers"])
    assert resp.status == 201, await resp.text()
    receipt = await resp.json()
    assert receipt["step"] == 4 and receipt["weights_sha256"] == hashlib.sha256(weights).hexdigest()
    d = cfg.state_dir / "runs" / job["job_id"] / "model_export" / "shards" / \
        f"stage-1-fellow-{f['fellow_id']}"
    back, arrays = load_shard(d)
    assert back["stage"] == 1 and "head.lm_head.weight" in arrays
    view = await (await client.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert view["latest_shard_pushes"]["1"]["step"] == 4
    assert not any(p.name.startswith(".weights") for p in d.iterdir()), "no temp files left"


@pytest.mark.parametrize("case, status, code", [
    ("no_session", 401, "unknown_session"),
    ("wrong_stage", 403, "wrong_fellow"),
    ("not_multipart", 415, "unsupported_media_type"),
    ("content_encoded", 415, "unsupported_media_type"),
    ("content_encoded_br", 415, "unsupported_media_type"),
    ("sha_mismatch", 400, "bad_request"),
    ("manifest_for_other_stage", 400, "bad_request"),
    ("parts_swapped", 400, "bad_request"),
    ("not_a_zip", 400, "bad_request"),
    ("too_big", 413, "body_too_large"),
])
async def test_push_shard_errors_change_nothing(leader, case, status, code):
    client, fellows, job, cfg = leader
    f = _stage_fellow(job, fellows, 0)
    other = _stage_fellow(job, fellows, 1)
    manifest, weights, _ = _shard(stage=0, fellow_id=f["fellow_id"], job_id=job["job_id"])
    url, headers = f"{A}/jobs/{job['job_id']}/shards/0", f["headers"]
    data: Any = _form(manifest, weights)
    if case == "no_session":
        headers = AUTH
    elif case == "wrong_stage":
        headers = other["headers"]
    elif case == "not_multipart":
        data = weights
    elif case in ("content_encoded", "content_encoded_br"):
        headers = {**headers, "Content-Encoding": "br" if case.endswith("br") else "gzip"}
    elif case == "sha_mismatch":
        data = _form({**manifest, "weights_sha256": "0" * 64}, weights)
    elif case == "manifest_for_other_stage":
        data = _form({**manifest, "stage": 1}, weights)
    elif case == "parts_swapped":
        data = _form(manifest, weights, order=("weights", "manifest"))
    elif case == "not_a_zip":
        junk = b"x" * 100
        data = _form({**manifest, "weights_sha256": hashlib.sha256(junk).hexdigest(),
                      "weights_bytes": 100}, junk)
    elif case == "too_big":
        big = b"\0" * 300_000
        data = _form({**manifest, "weights_sha256": hashlib.sha256(big).hexdigest()}, big)
    resp = await client.post(url, data=data, headers=headers)
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert err["code"] == code
    if case.startswith("content_encoded"):
        assert "without a Content-Encoding" in err["message"]
    shards = cfg.state_dir / "runs" / job["job_id"] / "model_export" / "shards"
    assert not list(shards.glob("*/weights.npz")) and not list(shards.glob("*/*.json"))
    view = await (await client.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert view["latest_shard_pushes"] == {}


async def test_push_for_unknown_or_finished_job(leader):
    client, fellows, job, _cfg = leader
    f = _stage_fellow(job, fellows, 0)
    manifest, weights, _ = _shard(stage=0, fellow_id=f["fellow_id"], job_id=job["job_id"])
    resp = await client.post(f"{A}/jobs/job-999999/shards/0", data=_form(manifest, weights),
                             headers=f["headers"])
    assert resp.status == 404
    await client.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH)
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/0",
                             data=_form(manifest, weights), headers=f["headers"])
    assert resp.status == 409


async def test_a_push_still_arriving_when_its_job_is_cancelled_changes_nothing(leader):
    """The job is cancelled while the push's weights are halfway in: the push is refused once
    it has arrived, and neither the export nor the ended job's record takes it."""
    client, fellows, job, cfg = leader
    f = _stage_fellow(job, fellows, 1)
    manifest, weights, _ = _shard(stage=1, fellow_id=f["fellow_id"], job_id=job["job_id"])
    form = _form(manifest, weights)
    body = bytearray()

    class Sink:
        async def write(self, chunk: bytes) -> None:
            body.extend(chunk)

    await form.write(Sink())
    cut = body.index(weights[:64]) + len(weights) // 2
    halfway, go_on = asyncio.Event(), asyncio.Event()

    async def chunks():
        yield bytes(body[:cut])
        halfway.set()
        await go_on.wait()
        yield bytes(body[cut:])

    push = asyncio.create_task(client.post(
        f"{A}/jobs/{job['job_id']}/shards/1", data=chunks(),
        headers={**f["headers"], "Content-Type": form.content_type}))
    await halfway.wait()
    cancel = await client.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH)
    assert cancel.status == 200, await cancel.text()
    go_on.set()
    resp = await push
    assert resp.status == 409, await resp.text()
    assert (await resp.json())["error"]["code"] == "job_not_running"
    runs = cfg.state_dir / "runs" / job["job_id"]
    left = [p for d in ("checkpoints", "model_export") for p in (runs / d).rglob("*")
            if p.is_file()]
    assert not left, "nothing of the push is left on disk"
    view = await (await client.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert view["state"] == "CANCELLED" and view["latest_shard_pushes"] == {}


async def test_checkpoint_fetch_for_resuming(leader):
    client, fellows, job, _cfg = leader
    f = _stage_fellow(job, fellows, 1)
    other = _stage_fellow(job, fellows, 0)
    manifest, weights, _ = _shard(stage=1, fellow_id=f["fellow_id"], job_id=job["job_id"])
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/1",
                             data=_form(manifest, weights), headers=f["headers"])
    assert resp.status == 201
    base = f"{A}/jobs/{job['job_id']}/checkpoints"
    got = await client.get(f"{base}/4/1/weights", headers=f["headers"])
    assert got.status == 200 and await got.read() == weights
    m = await (await client.get(f"{base}/4/1/manifest", headers=f["headers"])).json()
    assert m["weights_sha256"] == hashlib.sha256(weights).hexdigest() and m["step"] == 4
    for url, headers, status in ((f"{base}/4/1/weights", other["headers"], 403),
                                 (f"{base}/8/1/weights", f["headers"], 404),
                                 (f"{base}/4/1/optimizer", f["headers"], 404),
                                 (f"{base}/4/1/weights", AUTH, 401),
                                 (f"{base}/x/1/weights", f["headers"], 404)):
        resp = await client.get(url, headers=headers)
        assert resp.status == status, (url, await resp.text())
        assert "error" in await resp.json()


async def test_push_with_optimizer_state_is_stored_published_and_fetched(leader):
    client, fellows, job, cfg = leader
    f = _stage_fellow(job, fellows, 1)
    manifest, weights, optimizer = _checkpoint(1, f["fellow_id"], job["job_id"])
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/1",
                             data=_form(manifest, weights, optimizer=optimizer),
                             headers=f["headers"])
    assert resp.status == 201, await resp.text()
    runs = cfg.state_dir / "runs" / job["job_id"]
    assert (runs / "checkpoints" / "step-4" / "stage-1" / "optimizer.npz").read_bytes() \
        == optimizer
    export = runs / "model_export" / "shards" / f"stage-1-fellow-{f['fellow_id']}"
    assert (export / "optimizer.npz").read_bytes() == optimizer
    base = f"{A}/jobs/{job['job_id']}/checkpoints/4/1"
    got = await client.get(f"{base}/optimizer", headers=f["headers"])
    assert got.status == 200 and await got.read() == optimizer
    assert not [p for p in export.parent.parent.parent.rglob(".*") if p.is_file()], \
        "no temp files left"
    # Pushed again at the same step without optimiser state: no stale state stays behind.
    manifest2, weights2, _ = _shard(stage=1, fellow_id=f["fellow_id"], job_id=job["job_id"])
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/1",
                             data=_form(manifest2, weights2), headers=f["headers"])
    assert resp.status == 201, await resp.text()
    assert not (runs / "checkpoints" / "step-4" / "stage-1" / "optimizer.npz").exists()
    assert not (export / "optimizer.npz").exists()
    assert (await client.get(f"{base}/optimizer", headers=f["headers"])).status == 404


@pytest.mark.parametrize("case", ["sha_mismatch", "missing", "stray_param", "four_parts",
                                  "too_big", "not_a_zip"])
async def test_bad_optimizer_part_is_refused_and_changes_nothing(leader, case):
    client, fellows, job, cfg = leader
    f = _stage_fellow(job, fellows, 0)
    manifest, weights, optimizer = _checkpoint(0, f["fellow_id"], job["job_id"])
    data: Any = None
    if case == "sha_mismatch":
        data = _form({**manifest, "optimizer_sha256": "0" * 64}, weights, optimizer=optimizer)
    elif case == "missing":
        data = _form(manifest, weights)
    elif case == "stray_param":
        bad = npz_bytes({"blocks.7.attn.qkv.weight.exp_avg": np.zeros(2, np.float32)})
        data = _form({**manifest, "optimizer_sha256": hashlib.sha256(bad).hexdigest(),
                      "optimizer_bytes": len(bad)}, weights, optimizer=bad)
    elif case == "four_parts":
        data = _form(manifest, weights, optimizer=optimizer,
                     order=("manifest", "weights", "optimizer", "weights"))
    elif case == "too_big":  # (AdamW's two moments and DiLoCo's outer momentum, a little more)
        big = b"\0" * (OPTIMIZER_TIMES * cfg.max_upload_bytes + OPTIMIZER_SLACK + 1)
        data = _form({**manifest, "optimizer_sha256": hashlib.sha256(big).hexdigest(),
                      "optimizer_bytes": len(big)}, weights, optimizer=big)
    elif case == "not_a_zip":
        junk = b"y" * 64
        data = _form({**manifest, "optimizer_sha256": hashlib.sha256(junk).hexdigest(),
                      "optimizer_bytes": len(junk)}, weights, optimizer=junk)
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/0", data=data,
                             headers=f["headers"])
    assert resp.status == (413 if case == "too_big" else 400), await resp.text()
    err = (await resp.json())["error"]
    if case != "too_big":
        assert err["field"] == "optimizer", err
    runs = cfg.state_dir / "runs" / job["job_id"]
    assert not [p for p in runs.rglob("*") if p.is_file() and p.parent != runs], \
        "no shard file written"
    assert not list((runs / "checkpoints").glob("step-*")), "no checkpoint dir left"
    view = await (await client.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert view["latest_shard_pushes"] == {}


async def test_a_push_whose_step_is_pruned_meanwhile_is_a_conflict(leader, monkeypatch):
    """A newer complete checkpoint's publish() may prune an older step while a push for it is
    still arriving: the push is refused as a conflict, not an internal error."""
    import shutil

    from swarm_core.leader import uploads

    client, fellows, job, _cfg = leader
    f = _stage_fellow(job, fellows, 0)
    manifest, weights, optimizer = _checkpoint(0, f["fellow_id"], job["job_id"])
    original = uploads._check_weights

    def pruned_meanwhile(path, *args):  # type: ignore[no-untyped-def]
        original(path, *args)
        shutil.rmtree(path.parent.parent)  # checkpoints/step-4, as the pruning does

    monkeypatch.setattr(uploads, "_check_weights", pruned_meanwhile)
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/0",
                             data=_form(manifest, weights, optimizer=optimizer),
                             headers=f["headers"])
    assert resp.status == 409, await resp.text()
    err = (await resp.json())["error"]
    assert err["code"] == "checkpoint_pruned" and "step 4" in err["message"]
    view = await (await client.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert view["latest_shard_pushes"] == {}


async def test_a_shard_on_a_slow_disk_does_not_stall_the_leader(leader, monkeypatch):
    """A large shard's fsync takes long; on the event loop it held every heartbeat and every
    request of the leader for as long. Here each fsync takes 0.5 s: the push takes seconds,
    and the leader answers in the meantime at once."""
    import asyncio
    import time

    from swarm_core.leader import uploads

    real_fsync = os.fsync

    def slow_fsync(fd):  # type: ignore[no-untyped-def]
        time.sleep(0.5)
        real_fsync(fd)

    monkeypatch.setattr(uploads.os, "fsync", slow_fsync)
    client, fellows, job, _cfg = leader
    f = _stage_fellow(job, fellows, 0)
    manifest, weights, optimizer = _checkpoint(0, f["fellow_id"], job["job_id"])
    push = asyncio.create_task(client.post(f"{A}/jobs/{job['job_id']}/shards/0",
                                           data=_form(manifest, weights, optimizer=optimizer),
                                           headers=f["headers"]))
    slowest = 0.0  # the longest a round of one request and a 50 ms sleep took
    while not push.done():
        t0 = time.monotonic()
        resp = await client.get(f"{A}/info", headers=AUTH)
        assert resp.status == 200
        await asyncio.sleep(0.05)
        slowest = max(slowest, time.monotonic() - t0)
    assert (await push).status == 201
    assert slowest < 0.4, f"the leader stood still {slowest:.2f}s for the upload's disk work"


# --- the export download ---------------------------------------------------------------------


async def _push_both(client, fellows, job) -> dict[int, bytes]:
    weights_by_stage = {}
    for stage in (0, 1):
        f = _stage_fellow(job, fellows, stage)
        manifest, weights, _ = _shard(stage=stage, fellow_id=f["fellow_id"],
                                      job_id=job["job_id"])
        resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/{stage}",
                                 data=_form(manifest, weights), headers=f["headers"])
        assert resp.status == 201, await resp.text()
        weights_by_stage[stage] = weights
    return weights_by_stage


def _swarm_client(client):
    from swarm_core.client import SwarmClient

    return SwarmClient(str(client.server.make_url("")).rstrip("/"), TOKEN)


async def test_the_export_downloads_next_to_the_run_and_glues(leader, tmp_path):
    """What a sweep or suite runner copies: each stage's newest shard with the token, checked
    against its sha256, into <run>/model_export, where glue finds a whole model."""
    from swarm_core.artifacts.fetch import fetch_export
    from swarm_core.artifacts.glue import glue, load_full_model

    client, fellows, job, _cfg = leader
    weights = await _push_both(client, fellows, job)
    dest = tmp_path / "run" / "model_export"
    async with _swarm_client(client) as c:
        whole: list[str] = []  # the downloads read whole into memory
        read_whole = c._download

        async def recorded(url, *args, **kwargs):
            whole.append(url)
            return await read_whole(url, *args, **kwargs)

        c._download = recorded  # type: ignore[method-assign]
        run = await fetch_export(c, job["job_id"], dest)
    assert run["complete"] is True and run["step"] == 4 and run["num_stages"] == 2
    # The weights streamed to disk (a model's weights may not fit in memory); only the
    # manifests came whole, and nothing of the download is left beside the shards.
    assert [u.rsplit("/", 2)[-1] for u in whole] == ["manifest", "manifest"]
    assert sorted(p.name for p in (dest / "shards").iterdir()) == [
        e["dir"].split("/")[-1] for e in run["shards"]]
    for stage, entry in enumerate(run["shards"]):
        d = dest / entry["dir"]
        assert (d / "weights.npz").read_bytes() == weights[stage]
        assert load_shard(d)[0]["stage"] == stage
    assert (dest / "run_manifest.json").exists()
    model, _manifest = load_full_model(glue(dest))
    whole = ExperimentModel(ModelConfig(**MODEL), 32, 0, [(0, 1), (1, 2)])
    x = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x), whole.eval()(x))
    # Without the token, nothing comes.
    async with aiohttp.ClientSession() as anon:
        url = client.server.make_url(f"{A}/jobs/{job['job_id']}/export/0/weights")
        async with anon.get(url) as resp:
            assert resp.status == 401


@pytest.mark.parametrize("damage, message", [
    ("corrupt", "the weights do not match their manifest's sha256"),
    ("missing", "has no pushed shard of stage 1"),
])
async def test_a_bad_export_download_is_one_error_and_leaves_no_shard(leader, tmp_path, damage,
                                                                       message):
    from swarm_core.artifacts.fetch import FetchError, fetch_export
    from swarm_core.client import ClientError

    client, fellows, job, cfg = leader
    await _push_both(client, fellows, job)
    held = next((cfg.state_dir / "runs" / job["job_id"] / "model_export" / "shards").glob(
        "stage-1-fellow-*"))
    if damage == "corrupt":
        raw = bytearray((held / "weights.npz").read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        (held / "weights.npz").write_bytes(bytes(raw))
    else:
        (held / "weights.npz").unlink()
    dest = tmp_path / "run" / "model_export"
    async with _swarm_client(client) as c:
        with pytest.raises((FetchError, ClientError), match=message):
            await fetch_export(c, job["job_id"], dest)
    # Stage 0 downloaded fine, but nothing is written unless every stage is.
    assert not dest.exists() or not any(dest.rglob("*"))


# --- a replica's own state (DiLoCo) --------------------------------------------------------------


async def _diloco_job(aiohttp_client, tmp_path: Path):
    """A leader running a DiLoCo job of one stage and two replicas on two fellows: (client,
    the fellows by replica, the job, the config)."""
    client, fellows, cfg = await _leader_and_two_fellows(aiohttp_client, tmp_path)
    job = {"name": "d", "kind": "train", "model": MODEL,
           "training": {"steps": 8, "batch_size": 8, "micro_batches": 2,
                        "sync": {"mode": "diloco", "inner_steps": 2}},
           "topology": {"stages": 1, "replicas": 2}}
    job = await (await client.post(f"{A}/jobs", json=job, headers=AUTH)).json()
    assert job["state"] == "RUNNING", job
    by_replica = {}
    for cell in job["placement"]["stages"]:
        by_replica[cell["replica"]] = next(f for f in fellows
                                           if f["fellow_id"] == cell["fellow_id"])
    return client, by_replica, job, cfg


async def test_a_replicas_own_state_goes_beside_its_stage_checkpoint(aiohttp_client, tmp_path):
    """Under DiLoCo the leading member's shard names the other replicas whose optimiser
    states go with it; each pushes its own (manifest and optimizer, no weights) through the
    client. The checkpoint is complete, for a resume, only once they are all in; the state
    is never published as an export shard, and each replica fetches back exactly its own."""
    from swarm_core.artifacts.shards import param_shapes, replica_state_manifest
    from swarm_core.client import SwarmClient
    from swarm_core.leader.uploads import complete_checkpoints

    client, fellows, job, cfg = await _diloco_job(aiohttp_client, tmp_path)
    job_id = job["job_id"]
    swarm = SwarmClient(str(client.server.make_url("")).rstrip("/"), TOKEN)
    runs = cfg.state_dir / "runs"
    lead, other = fellows[0], fellows[1]
    module, opt = _trained(0)
    arrays = state_arrays(module)
    weights = npz_bytes(arrays)
    lead_opt = npz_bytes(optimizer_arrays(opt, module))
    manifest = build_manifest(job_id=job_id, stage=0, num_stages=1,
                              fellow_id=lead["fellow_id"], fellow_name="f", layers=(0, 2),
                              step=4, model=MODEL, seed=0, vocab_size=32,
                              tokenizer={"name": "byte"}, arrays=arrays, weights=weights,
                              optimizer=lead_opt, replica=0, replica_states=(1,))
    # The other replica's moments differ from the first's (its own share of the windows).
    module(torch.randint(0, 32, (2, 8))).float().pow(3).mean().backward()
    opt.step()
    own = npz_bytes(optimizer_arrays(opt, module))
    own_manifest = replica_state_manifest(
        job_id=job_id, stage=0, fellow_id=other["fellow_id"], replica=1, step=4, model=MODEL,
        seed=0, vocab_size=32, params=param_shapes(module), optimizer=own)
    try:
        await swarm.push_shard(job_id, 0, lead["session"], manifest, weights, lead_opt)
        assert complete_checkpoints(runs, job_id, 1) == [], "replica 1's state is missing"
        # Pushed by the fellow of replica 0 it is refused (403), with a replica the job does
        # not have too (400); neither leaves anything.
        for session, replica, status in ((lead["session"], 1, 403),
                                         (other["session"], 2, 400)):
            bad = {**own_manifest, "replica": replica,
                   "fellow_id": lead["fellow_id"] if status == 403 else other["fellow_id"]}
            with pytest.raises(Exception) as err:
                await swarm.push_shard(job_id, 0, session, bad, None, own)
            assert getattr(err.value, "status", None) == status, err.value
        assert not (runs / job_id / "checkpoints" / "step-4" / "stage-0" / "replica-1").exists()
        await swarm.push_shard(job_id, 0, other["session"], own_manifest, None, own)
        assert complete_checkpoints(runs, job_id, 1) == [4]
        got = await swarm.replica_state(job_id, 4, 0, 1, other["session"])
        assert got is not None
        back_manifest, back = got
        assert back == own and back_manifest["replica"] == 1
        assert optimizer_from_checkpoint(back_manifest, back) is not None
        assert await swarm.replica_state(job_id, 4, 0, 0, other["session"]) is None
        base = f"{A}/jobs/{job_id}/checkpoints/4/0/replicas/1"
        for url, headers, status in ((f"{base}/weights", other["headers"], 404),
                                     (f"{base}/optimizer", AUTH, 401),
                                     (f"{A}/jobs/{job_id}/checkpoints/4/0/replicas/x/optimizer",
                                      other["headers"], 404)):
            resp = await client.get(url, headers=headers)
            assert resp.status == status and "error" in await resp.json(), url
        ck_manifest, ck_weights, ck_opt = await swarm.checkpoint(job_id, 4, 0, lead["session"])
        assert (ck_weights, ck_opt, ck_manifest["replica_states"]) == (weights, lead_opt, [1])
        shards = runs / job_id / "model_export" / "shards"
        assert [p.name for p in shards.iterdir()] == [f"stage-0-fellow-{lead['fellow_id']}"]
        assert (shards / f"stage-0-fellow-{lead['fellow_id']}" / "optimizer.npz").read_bytes() \
            == lead_opt
        # Once replica 0 has left, replica 1 leads: its fellow's shard of the stage is taken
        # (the push is checked against the cell it names) and becomes the export.
        led = build_manifest(job_id=job_id, stage=0, num_stages=1,
                             fellow_id=other["fellow_id"], fellow_name="g", layers=(0, 2),
                             step=6, model=MODEL, seed=0, vocab_size=32,
                             tokenizer={"name": "byte"}, arrays=arrays, weights=weights,
                             optimizer=own, replica=1)
        await swarm.push_shard(job_id, 0, other["session"], led, weights, own)
        assert complete_checkpoints(runs, job_id, 1) == [6, 4]
        assert [p.name for p in shards.iterdir()] == [f"stage-0-fellow-{other['fellow_id']}"]
    finally:
        await swarm.close()


# --- the manifest, typed as it comes in ----------------------------------------------------------


async def test_a_pushed_manifest_is_kept_as_it_came_and_read_as_its_class(leader):
    """The leader structures a push's manifest once (ShardManifest) and reads that; the file it
    keeps is the manifest as the fellow wrote it, byte for byte, keys it does not know
    included, with only its own received_at added."""
    from swarm_core import jsonio

    client, fellows, job, cfg = leader
    f = _stage_fellow(job, fellows, 0)
    manifest, weights, _ = _shard(stage=0, fellow_id=f["fellow_id"], job_id=job["job_id"])
    manifest = {**manifest, "from_a_newer_fellow": {"kept": [1, 2.5, None]}}
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/0", data=_form(manifest, weights),
                             headers=f["headers"])
    assert resp.status == 201, await resp.text()
    receipt = await resp.json()
    d = cfg.state_dir / "runs" / job["job_id"] / "model_export" / "shards" / \
        f"stage-0-fellow-{f['fellow_id']}"
    for kept in (d, cfg.state_dir / "runs" / job["job_id"] / "checkpoints" / "step-4" /
                 "stage-0"):
        raw = (kept / "shard_manifest.json").read_bytes()
        stored = jsonio.loads(raw)
        assert raw == jsonio.dumps({**manifest, "received_at": stored["received_at"]},
                                   pretty=True)
    assert receipt["received_at"] == stored["received_at"] and receipt["weights_bytes"] == \
        len(weights) and receipt["config_fingerprint"] == manifest["config_fingerprint"]


async def test_a_manifest_from_before_its_newer_fields_is_taken(leader):
    """A fellow of an older version wrote no optimiser, replica or placement fields: they
    take their defaults."""
    client, fellows, job, _cfg = leader
    f = _stage_fellow(job, fellows, 1)
    manifest, weights, _ = _shard(stage=1, fellow_id=f["fellow_id"], job_id=job["job_id"])
    for key in ("format", "fellow_name", "slot", "device", "has_embedding", "has_head",
                "training", "weights_bytes", "optimizer_sha256", "optimizer_bytes", "replica",
                "replica_states", "created_at"):
        del manifest[key]
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/1", data=_form(manifest, weights),
                             headers=f["headers"])
    assert resp.status == 201, await resp.text()
    assert (await resp.json())["optimizer_bytes"] is None


@pytest.mark.parametrize("change, field, message", [
    ({"job_id": None}, "manifest.job_id", "expected a string, got null"),
    ({"step": -1}, "manifest.step", "must be >= 0, got -1"),
    ({"step": "4"}, "manifest.step", "expected an integer, got a string"),
    ({"layers": {"start": 1, "stop": 0}}, "manifest.layers.stop", "0 is before start 1"),
    ({"params": ["w"]}, "manifest.params", "expected an object, got a list"),
    ({"optimizer_bytes": -5}, "manifest.optimizer_bytes", "must be a byte count"),
    ({"replica_states": [0]}, "manifest.replica_states", "must list other replicas"),
    ({"replica": 1}, "manifest.replica", "must be an integer from 0 to 0"),
    ({"weights_sha256": None}, "manifest.optimizer_sha256",
     "expected a string, got null (no weights_sha256: read as a replica's own optimiser "
     "state)"),
    ({"fellow_id": 99}, "manifest.fellow_id", "manifest fellow_id is 99, expected"),
])
async def test_a_bad_manifest_is_a_400_naming_its_field(leader, change, field, message):
    client, fellows, job, cfg = leader
    f = _stage_fellow(job, fellows, 0)
    manifest, weights, _ = _shard(stage=0, fellow_id=f["fellow_id"], job_id=job["job_id"])
    resp = await client.post(f"{A}/jobs/{job['job_id']}/shards/0",
                             data=_form({**manifest, **change}, weights), headers=f["headers"])
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["field"] == field and message in err["message"], err
    assert "\n" not in err["message"]
    runs = cfg.state_dir / "runs" / job["job_id"]
    assert not list(runs.rglob("shard_manifest.json")) and not list(runs.rglob("*.npz"))
    view = await (await client.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert view["latest_shard_pushes"] == {}
