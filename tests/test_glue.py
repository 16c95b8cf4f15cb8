"""Glue: shards back into one model, and every way a set of shards can be wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm_core.artifacts.glue import GlueError, glue, load_full_model
from swarm_core.artifacts.shards import build_manifest, npz_bytes, state_arrays, write_shard
from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.model import ExperimentModel, StageModule

MODEL = {"d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8,
         "compression": "learned_dim4_int8"}
RANGES = [(0, 1), (1, 3), (3, 4)]


def export(tmp: Path, ranges=RANGES, model=MODEL, seed=0, steps=None, skip=()) -> Path:
    root = tmp / "model_export"
    mc = ModelConfig(**model)
    for s, (a, b) in enumerate(ranges):
        if s in skip:
            continue
        module = StageModule(mc, 40, seed, a, b, s, len(ranges))
        arrays = state_arrays(module)
        weights = npz_bytes(arrays)
        step = steps[s] if steps else 10
        manifest = build_manifest(job_id="job-1", stage=s, num_stages=len(ranges), fellow_id=s,
                                  fellow_name=f"f{s}", layers=(a, b), step=step, model=model,
                                  seed=seed, vocab_size=40, tokenizer={"name": "byte"},
                                  arrays=arrays, weights=weights, training={"seed": 0})
        write_shard(root / "shards", manifest, weights)
    return root


def test_glue_rebuilds_the_model_with_bottleneck_halves_rejoined(tmp_path):
    out = glue(export(tmp_path))
    model, manifest = load_full_model(out)
    reference = ExperimentModel(ModelConfig(**MODEL), 40, 0, RANGES)
    assert manifest["stage_ranges"] == [list(r) for r in RANGES]
    assert [s["stage"] for s in manifest["sources"]] == [0, 1, 2]
    x = torch.randint(0, 40, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x), reference.eval()(x))
    with np.load(out / "weights.npz", allow_pickle=False) as z:
        # Global names: both bottlenecks' halves are there, each under its boundary index.
        assert {"blocks.0.attn.qkv.weight", "head.lm_head.weight", "down.0.proj.weight",
                "up.0.proj.weight", "down.1.proj.weight", "up.1.proj.weight"} <= set(z.files)


def test_a_one_stage_model_with_tied_weights_glues_and_stays_tied(tmp_path):
    tied = {**MODEL, "compression": "none", "tie_weights": True}
    stage = StageModule(ModelConfig(**tied), 40, 0, 0, 4, 0, 1)
    assert stage.tied and stage.head.lm_head.weight is stage.embed.tok.weight
    split = StageModule(ModelConfig(**tied), 40, 0, 0, 2, 0, 2)
    assert not split.tied, "split across stages, the weights stay untied"
    out = glue(export(tmp_path, ranges=[(0, 4)], model=tied))
    model, _ = load_full_model(out)
    only = model.stages[0]
    assert only.head.lm_head.weight is only.embed.tok.weight  # still one parameter
    assert torch.equal(only.embed.tok.weight, stage.embed.tok.weight)
    x = torch.randint(0, 40, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x), stage.eval()(x))


@pytest.mark.parametrize("breakage, message", [
    ("missing_stage", "missing stage(s) [1] of 3"),
    ("overlap", "layer 1 is held by stage 0 and stage 1"),
    ("gap", "no shard holds layer(s) [3]"),
    ("fingerprint", "config fingerprints differ"),
    ("steps", "shards come from different steps (stage 0 at 10, stage 1 at 8"),
    ("tampered", "does not match the manifest's sha256"),
    ("no_shards", "no shards/ directory"),
    ("duplicate", "stage 1 appears twice"),
])
def test_glue_errors(tmp_path, breakage, message):
    if breakage == "missing_stage":
        root = export(tmp_path, skip=(1,))
    elif breakage == "overlap":
        root = export(tmp_path, ranges=[(0, 2), (1, 3), (3, 4)])
    elif breakage == "gap":
        root = export(tmp_path, ranges=[(0, 1), (1, 3), (4, 4)])
    elif breakage == "fingerprint":
        root = export(tmp_path)
        other = export(tmp_path / "other", seed=1)
        shutil.rmtree(root / "shards" / "stage-2-fellow-2")
        shutil.copytree(other / "shards" / "stage-2-fellow-2", root / "shards" / "stage-2-fellow-2")
    elif breakage == "steps":
        root = export(tmp_path, steps=[10, 8, 10])
    elif breakage == "tampered":
        root = export(tmp_path)
        w = root / "shards" / "stage-1-fellow-1" / "weights.npz"
        data = bytearray(w.read_bytes())
        data[len(data) // 2] ^= 0xFF
        w.write_bytes(bytes(data))
    elif breakage == "no_shards":
        root = tmp_path / "empty"
        root.mkdir()
    elif breakage == "duplicate":
        root = export(tmp_path)
        d = root / "shards" / "stage-1-fellow-1"
        copy = root / "shards" / "stage-1-fellow-9"
        shutil.copytree(d, copy)
        m = json.loads((copy / "shard_manifest.json").read_text())
        m["fellow_id"] = 9
        (copy / "shard_manifest.json").write_text(json.dumps(m))
    with pytest.raises(GlueError) as exc:
        glue(root)
    assert message in str(exc.value)
    assert not (root / "full_model").exists(), "nothing written on error"
