"""The glued model for other tools: ``model.safetensors`` read back with the ``safetensors``
package equals ``weights.npz``, ``config.json`` rebuilds the model, and ``swarm generate
EXPORT_DIR`` samples text from a real export."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load, load_file

import swarm_core.artifacts.glue as glue_mod
from swarm_core.artifacts.export_formats import model_config
from swarm_core.artifacts.glue import GlueError, glue, load_full_model
from swarm_core.artifacts.manifests import model_manifest
from swarm_core.artifacts.safetensors_file import safetensors_bytes
from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.whole import ExperimentModel
from swarm_tui.cli import run
from tests.support import GLUE_MODEL, GLUE_RANGES, export

BYTE = {"name": "byte", "vocab_size": 256}


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    """A three-stage byte-level run's model_export, glued (a learned bottleneck at each edge)."""
    root = export(tmp_path / "run", vocab=256, tokenizer=BYTE)
    glue(root)
    return root


def npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


# --- the files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [GLUE_MODEL, {**GLUE_MODEL, "compression": "none",
                                                 "tie_weights": True}])
def test_safetensors_read_back_with_the_package_is_the_npz(tmp_path, model):
    ranges = GLUE_RANGES if not model.get("tie_weights") else [(0, 4)]
    out = glue(export(tmp_path, ranges=ranges, model=model))
    tensors, weights = load_file(out / "model.safetensors"), npz(out / "weights.npz")
    assert sorted(tensors) == sorted(weights) and len(weights) > 10
    for name, array in weights.items():
        assert tensors[name].dtype == array.dtype, name
        assert tensors[name].shape == array.shape, name
        assert np.array_equal(tensors[name], array), name
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "silentswarm-gpt", "config": "config.json",
                                "job_id": "job-1", "step": "10"}
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert json.loads((out / "config.json").read_text())["weights_sha256"] == sha
    assert json.loads((out / "inference_manifest.json").read_text())["safetensors_sha256"] == sha


def test_config_json_round_trips_to_the_model_config_and_rebuilds_the_model(export_dir):
    out = export_dir / "full_model"
    config = json.loads((out / "config.json").read_text())
    _, cfg = model_manifest(json.loads((out / "inference_manifest.json").read_text()))
    assert config["format"] == "silentswarm-gpt" and config["vocab_size"] == 256
    assert config["tokenizer"] == BYTE
    assert model_config(config) == attrs.evolve(cfg, vocab_size=256)
    assert model_config(config) == attrs.evolve(ModelConfig(**GLUE_MODEL, init="torch"),
                                                vocab_size=256)
    # What a researcher's script does: the model from config.json, the weights from safetensors.
    ranges = [(a, b) for a, b in config["stage_ranges"]]
    rebuilt = ExperimentModel(model_config(config), config["vocab_size"], config["seed"], ranges)
    tensors = load_file(out / config["weights"])
    for stage in rebuilt.stages:
        stage.load_state_dict({k: torch.from_numpy(tensors[k]) for k in stage.state_dict()},
                              strict=True)
    glued, _ = load_full_model(out)
    x = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x), glued(x))


def test_the_writer_matches_the_format_for_every_dtype_it_names():
    arrays = {"f16": np.arange(6, dtype=np.float16).reshape(2, 3),
              "f64": np.array([1.5, -2.0]), "i64": np.array([[-1, 2**40]]),
              "u8": np.arange(3, dtype=np.uint8), "bool": np.array([True, False]),
              "scalar": np.array(3.0, np.float32), "empty": np.zeros((0, 4), np.float32),
              "big_endian": np.array([1.0, 2.0], dtype=">f4"),
              "strided": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]}
    raw = safetensors_bytes(arrays, {"k": "v"})
    assert raw == safetensors_bytes(dict(reversed(arrays.items())), {"k": "v"}), "name order"
    (size,) = struct.unpack("<Q", raw[:8])
    assert size % 8 == 0 and raw[8:8 + size].rstrip(b" ").endswith(b"}")
    back = load(raw)
    assert sorted(back) == sorted(arrays)
    for name, array in arrays.items():
        assert back[name].shape == array.shape and np.array_equal(back[name], array), name
        assert back[name].dtype == array.dtype.newbyteorder("="), name
    with pytest.raises(ValueError, match="c: dtype complex64 has no safetensors name"):
        safetensors_bytes({"c": np.zeros(2, np.complex64)})


def test_a_reglue_stopped_before_its_config_leaves_no_stale_config(export_dir, monkeypatch):
    """config.json vouches for the safetensors beside it, as the manifest does for the npz:
    a glue stopped between them leaves neither an old config nor an old manifest."""
    out = export_dir / "full_model"
    real = glue_mod.atomic_write

    def full_disk(path: Path, data: bytes, mode: int = 0o644) -> None:
        if path.name == "config.json":
            raise OSError(28, "No space left on device")
        real(path, data, mode)

    monkeypatch.setattr(glue_mod, "atomic_write", full_disk)
    with pytest.raises(GlueError, match="No space left on device"):
        glue(export_dir)
    assert not (out / "config.json").exists()
    assert not (out / "inference_manifest.json").exists()


def test_glue_refuses_an_output_file_that_is_a_directory(tmp_path):
    root = export(tmp_path)
    (root / "full_model" / "model.safetensors").mkdir(parents=True)
    with pytest.raises(GlueError, match=r"full_model/model.safetensors is a directory"):
        glue(root)
    assert not (root / "full_model" / "weights.npz").exists(), "nothing written"


# --- swarm generate EXPORT_DIR -----------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = run(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_samples_the_asked_tokens_the_same_for_a_seed(export_dir, capsys):
    gen = ["generate", str(export_dir), "--prompt", "To be", "--tokens", "20"]
    code, out, err = cli(capsys, *gen, "--seed", "7", "--format", "json")
    assert code == 0 and err == ""
    result = json.loads(out)
    assert result["prompt"] == "To be" and result["tokens"] == 20
    assert result["text"].startswith("To be")
    # Past the model's window (seq_len 8): each token is drawn from the last 8 ids.
    again = json.loads(cli(capsys, *gen, "--seed", "7", "--format", "json")[1])
    assert again == result
    table = cli(capsys, *gen, "--seed", "7")[1]  # (control characters shown as spaces)
    assert table.startswith("To be") and table == cli(capsys, *gen, "--seed", "7")[1]
    others = {json.loads(cli(capsys, *gen, "--seed", str(s), "--format", "json")[1])["text"]
              for s in range(1, 4)}
    assert others - {result["text"]}, "another seed, another text"
    # The full_model directory and --model name the same model.
    for where in (["generate", str(export_dir / "full_model")],
                  ["generate", "--model", str(export_dir / "full_model")]):
        argv = [*where, "--prompt", "To be", "--tokens", "20", "--seed", "7", "--format", "json"]
        assert json.loads(cli(capsys, *argv)[1]) == result


def test_generate_with_top_k_and_temperature(export_dir, capsys):
    code, out, _ = cli(capsys, "generate", str(export_dir), "--prompt", "a", "--tokens", "5",
                       "--top-k", "1", "--temperature", "0.5", "--format", "json")
    assert code == 0 and json.loads(out)["tokens"] == 5
    greedy = json.loads(out)["text"]
    code, out, _ = cli(capsys, "generate", str(export_dir), "--prompt", "a", "--tokens", "5",
                       "--top-k", "1", "--seed", "99", "--format", "json")
    assert json.loads(out)["text"] == greedy, "top-1 is greedy whatever the seed"


@pytest.mark.parametrize("target, extra, code, message", [
    ("missing", [], 1, "missing: no such directory"),
    ("file", [], 1, "a-file is not a directory"),
    ("empty", [], 1, "empty: not a model export (no full_model/ or inference_manifest.json"),
    ("unglued", [], 1, "model_export: not glued yet (run `swarm glue "),
    ("export", ["--tokens", "0"], 2, "argument --tokens: token count must be >= 1"),
    ("export", ["--temperature", "0"], 2, "argument --temperature: temperature must be > 0"),
    ("export", ["--model", "x"], 2, "give EXPORT_DIR or --model, not both"),
    (None, [], 2, "generate needs EXPORT_DIR: a run's model_export directory"),
])
def test_generate_errors_are_one_line(tmp_path, capsys, target, extra, code, message):
    paths = {"missing": tmp_path / "missing", "file": tmp_path / "a-file",
             "empty": tmp_path / "empty", "unglued": export(tmp_path / "raw"),
             "export": tmp_path / "export"}
    paths["file"].write_text("x")
    paths["empty"].mkdir()
    argv = ["generate", *([str(paths[target])] if target else []), "--prompt", "x", *extra]
    got, out, err = cli(capsys, *argv)
    assert got == code and out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and message in err, err


def test_generate_names_the_glued_files_it_read_when_given_the_export(tmp_path, capsys):
    root = export(tmp_path / "narrow", vocab=40, tokenizer=BYTE)
    glue(root)
    code, _, err = cli(capsys, "generate", str(root), "--prompt", "ab")
    assert code == 1 and err.count("\n") == 1
    assert "full_model/inference_manifest.json: vocab_size 40 is smaller than its " \
           "tokenizer's 256 tokens" in err, err
