"""Glue: shards back into one model, and every way a set of shards can be wrong."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm_core.artifacts.glue import GlueError, glue, load_full_model
from swarm_core.artifacts.shards import npz_bytes
from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.whole import ExperimentModel
from tests.support import GLUE_MODEL, GLUE_RANGES, export

MODEL, RANGES = GLUE_MODEL, GLUE_RANGES


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
    ("other_job", "shards come from different jobs (job-1, job-2)"),
    ("no_field", "stage-1-fellow-1/shard_manifest.json: $.stage: required field missing"),
    ("wrong_type", "stage-1-fellow-1/shard_manifest.json: $.step: expected an integer, got a "
                   "string"),
    ("pickled", "stage-1-fellow-1/weights.npz: an array holds pickled objects"),
    ("not_npz", "stage-1-fellow-1/weights.npz: not an .npz archive"),
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
    elif breakage == "other_job":  # same model, seed and step: only the job tells them apart
        root = export(tmp_path)
        other = export(tmp_path / "other", job_id="job-2")
        shutil.rmtree(root / "shards" / "stage-2-fellow-2")
        shutil.copytree(other / "shards" / "stage-2-fellow-2", root / "shards" / "stage-2-fellow-2")
    elif breakage in ("no_field", "wrong_type"):
        root = export(tmp_path)
        path = root / "shards" / "stage-1-fellow-1" / "shard_manifest.json"
        m = json.loads(path.read_text())
        if breakage == "no_field":
            del m["stage"]
        else:
            m["step"] = "10"
        path.write_text(json.dumps(m))
    elif breakage in ("pickled", "not_npz"):  # with a manifest that vouches for the bytes
        root = export(tmp_path)
        d = root / "shards" / "stage-1-fellow-1"
        if breakage == "pickled":
            buf = io.BytesIO()
            np.savez(buf, w=np.array([{"x": 1}], dtype=object))
            raw = buf.getvalue()
        else:
            raw = b"\x00not an archive" * 10
        (d / "weights.npz").write_bytes(raw)
        m = json.loads((d / "shard_manifest.json").read_text())
        m["weights_sha256"] = hashlib.sha256(raw).hexdigest()
        (d / "shard_manifest.json").write_text(json.dumps(m))
    with pytest.raises(GlueError) as exc:
        glue(root)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not (root / "full_model").exists(), "nothing written on error"


def test_a_reglue_stopped_before_its_manifest_leaves_no_stale_manifest(tmp_path, monkeypatch):
    """Glue again over a glued model, with the disk full after the weights: the old manifest
    must not stay beside new weights; what is left says to run the glue step."""
    import swarm_core.artifacts.glue as glue_mod

    root = export(tmp_path)
    out = glue(root)
    old_sha = json.loads((out / "inference_manifest.json").read_text())["weights_sha256"]
    shutil.rmtree(root / "shards")
    export(tmp_path, seed=1)  # other weights, the same layout
    real = glue_mod.atomic_write

    def full_disk(path: Path, data: bytes, mode: int = 0o644) -> None:
        if path.name == "inference_manifest.json":
            raise OSError(28, "No space left on device")
        real(path, data, mode)

    monkeypatch.setattr(glue_mod, "atomic_write", full_disk)
    with pytest.raises(GlueError, match="No space left on device"):
        glue(root)
    assert not (out / "inference_manifest.json").exists()
    assert hashlib.sha256((out / "weights.npz").read_bytes()).hexdigest() != old_sha
    with pytest.raises(GlueError, match=r"inference_manifest.json.*\(run the glue step\)"):
        load_full_model(out)


@pytest.mark.parametrize("breakage, message", [
    ("shape", "weights do not fit the model: size mismatch for blocks.0"),
    ("no_sha", "inference_manifest.json: $.weights_sha256: required field missing"),
    ("ranges", "inference_manifest.json: $.stage_ranges[0][1]: expected an integer"),
])
def test_a_broken_glued_model_is_one_clear_error(tmp_path, breakage, message):
    out = glue(export(tmp_path))
    manifest = json.loads((out / "inference_manifest.json").read_text())
    if breakage == "shape":
        with np.load(out / "weights.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        key = next(k for k in arrays if k.startswith("blocks.0."))
        arrays[key] = np.zeros((3, 3), np.float32)
        raw = npz_bytes(arrays)
        (out / "weights.npz").write_bytes(raw)
        manifest["weights_sha256"] = hashlib.sha256(raw).hexdigest()
    elif breakage == "no_sha":
        del manifest["weights_sha256"]
    else:
        manifest["stage_ranges"] = [[0, "1"]]
    (out / "inference_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GlueError) as exc:
        load_full_model(out)
    assert message in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_generate_and_eval_use_the_tokenizer_the_model_learned(tmp_path, capsys):
    """generate needs no corpus for a byte model; a BPE model's tokenizer is read from the
    file its run recorded. When the corpus has changed since, eval (and generate without the
    file) refuse in one line, rather than read token ids as other text."""
    from swarm_core.config.schemas import TrainingConfig
    from swarm_core.data import load_token_data
    from swarm_core.schema import unstructure
    from swarm_tui.cli import run

    def cli(*argv: str) -> tuple[int, str, str]:
        code = run(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    gone = {"seed": 0, "dataset": "textfiles", "dataset_paths": [str(tmp_path / "gone/*.txt")]}
    byte = glue(export(tmp_path / "byte", vocab=256, training=gone,
                       tokenizer={"name": "byte", "vocab_size": 256}))
    code, out, _ = cli("generate", "--model", str(byte), "--prompt", "ab", "--tokens", "3",
                       "--format", "json")
    assert code == 0 and json.loads(out)["text"].startswith("ab")
    code, _, err = cli("eval", "--model", str(byte))
    assert code != 0 and "matches no file" in err and err.count("\n") == 1

    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(f"word{i % 50} thing{i % 7}" for i in range(4000)))
    cfg = TrainingConfig(dataset="textfiles", dataset_paths=[str(corpus)], tokenizer="bpe",
                         bpe_vocab_size=300, batch_size=4, micro_batches=2, eval_batches=1)
    data = load_token_data(cfg, MODEL["seq_len"])
    bpe = glue(export(tmp_path / "bpe", vocab=data.vocab_size, training=unstructure(cfg),
                      tokenizer=data.tokenizer.spec()))
    assert cli("eval", "--model", str(bpe))[0] == 0
    corpus.write_text(" ".join(f"other{i % 30} stuff{i % 11}" for i in range(4000)))
    code, _, err = cli("eval", "--model", str(bpe))
    assert code != 0 and "not the one the model was trained with" in err
    code, out, _ = cli("generate", "--model", str(bpe), "--prompt", "word1", "--tokens", "3",
                       "--format", "json")
    assert code == 0 and json.loads(out)["text"].startswith("word1")
    Path(data.tokenizer.spec()["file"]).unlink()
    code, _, err = cli("generate", "--model", str(bpe), "--prompt", "word1")
    assert code != 0 and "not the one the model was trained with" in err
