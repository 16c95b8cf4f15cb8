"""Bad input to glue, eval and generate: one line that names what is wrong, a non-zero exit, and
nothing written or changed. Real shards of a two-stage run, real glue, the CLI in-process (and
once as a process, for argv bytes that are not UTF-8)."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from swarm_core.artifacts.glue import GlueError, glue
from swarm_tui.cli import run
from tests.support import export, swarm_argv

RANGES = [(0, 2), (2, 4)]
BYTE = {"name": "byte", "vocab_size": 256}


@pytest.fixture
def training(tmp_path: Path) -> dict[str, Any]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"word{i % 50} thing{i % 7}" for i in range(400)))
    return {"seed": 0, "dataset": "textfiles", "dataset_paths": [str(corpus)],
            "batch_size": 4, "micro_batches": 2, "eval_batches": 1}


@pytest.fixture
def export_dir(tmp_path: Path, training: dict[str, Any]) -> Path:
    """D: a two-stage run's model_export directory."""
    return export(tmp_path / "run", ranges=RANGES, vocab=256, training=training, tokenizer=BYTE)


@pytest.fixture
def full_model(export_dir: Path) -> Path:
    """FM: D glued."""
    return glue(export_dir)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = run(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    _, err = capsys.readouterr()
    return code, err


def one_line(err: str, *parts: str) -> None:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "internal error" not in err and "Traceback" not in err, err
    for part in parts:
        assert part in err, err


def snapshot(root: Path) -> dict[str, Any]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def vouch(manifest: Path, weights: Path, raw: bytes) -> None:
    """Replace the weights and update the manifest's sha256 to match: only the bytes are bad."""
    weights.write_bytes(raw)
    edit_json(manifest, lambda m: m.update(weights_sha256=hashlib.sha256(raw).hexdigest()))


def lying_header(raw: bytes, shape: tuple[int, ...]) -> bytes:
    """The archive with its first member's .npy header claiming ``shape``, data unchanged."""
    src = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for i, info in enumerate(src.infolist()):
            data = src.read(info)
            if i == 0:
                buf = io.BytesIO()
                np.lib.format.write_array_header_1_0(
                    buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
                data = buf.getvalue() + data[len(buf.getvalue()):]
            dst.writestr(info.filename, data)
    return out.getvalue()


def compressed(raw: bytes) -> bytes:
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


# --- glue ---------------------------------------------------------------------------------------


def _shard(root: Path, stage: int) -> Path:
    return root / "shards" / f"stage-{stage}-fellow-{stage}"


def _every_manifest(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    for s in range(len(RANGES)):
        edit_json(_shard(root, s) / "shard_manifest.json", change)


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _break_export(root: Path, breakage: str) -> None:
    one = _shard(root, 1)
    if breakage == "num_stages":  # a count that sized set(range(n)): 24 GB
        _every_manifest(root, lambda m: m.update(num_stages=10**12))
    elif breakage == "layers_stop":
        edit_json(one / "shard_manifest.json", lambda m: m["layers"].update(stop=10**12))
    elif breakage == "layers_reversed":
        edit_json(one / "shard_manifest.json", lambda m: m["layers"].update(start=3, stop=2))
    elif breakage == "stage_past_count":
        edit_json(one / "shard_manifest.json", lambda m: m.update(stage=5))
    elif breakage in ("vocab_negative", "vocab_huge"):
        vocab = -1 if breakage == "vocab_negative" else 10**12
        _every_manifest(root, lambda m: m.update(vocab_size=vocab))
    elif breakage == "wide_model":  # would be GBs of parameters, were it built
        _every_manifest(root, lambda m: m["model"].update(d_model=16384))
    elif breakage == "many_layers":
        _every_manifest(root, lambda m: m["model"].update(n_layers=1024))
    elif breakage == "manifest_is_dir":
        _replace_with_dir(one / "shard_manifest.json")
    elif breakage == "weights_is_dir":
        _replace_with_dir(one / "weights.npz")
    elif breakage == "full_model_is_file":
        (root / "full_model").write_bytes(b"keep me")
    elif breakage == "output_weights_is_dir":
        (root / "full_model" / "weights.npz").mkdir(parents=True)
    elif breakage in ("npy_header", "compressed"):
        raw = (one / "weights.npz").read_bytes()
        bad = lying_header(raw, (99999999999,)) if breakage == "npy_header" else compressed(raw)
        vouch(one / "shard_manifest.json", one / "weights.npz", bad)
    else:
        raise AssertionError(breakage)


@pytest.mark.parametrize("breakage, message", [
    ("num_stages", "stage-0-fellow-0/shard_manifest.json: $.num_stages: 1000000000000 stages "
                   "for 4 layers (at most 6)"),
    ("layers_stop", "stage-1-fellow-1/shard_manifest.json: $.layers.stop: 1000000000000 is "
                    "past the model's 4 layers"),
    ("layers_reversed", "stage-1-fellow-1/shard_manifest.json: $.layers.stop: 2 is before "
                        "start 3"),
    ("stage_past_count", "stage-1-fellow-1/shard_manifest.json: $.stage: 5 is not below "
                         "num_stages 2"),
    ("vocab_negative", "shard_manifest.json: $.vocab_size: must be 2..1048576 or null"),
    ("vocab_huge", "shard_manifest.json: $.vocab_size: must be 2..1048576 or null"),
    ("wide_model", "weights do not fit the model: size mismatch for embed.tok.weight: "
                   "[256, 16] in the weights, [256, 16384] in the model"),
    ("many_layers", "no shard holds layer(s) [4, 5, 6,"),
    ("manifest_is_dir", "stage-1-fellow-1/shard_manifest.json: cannot read it (Is a directory)"),
    ("weights_is_dir", "stage-1-fellow-1/weights.npz: cannot read it (Is a directory)"),
    ("full_model_is_file", "full_model exists and is not a directory"),
    ("output_weights_is_dir", "full_model/weights.npz is a directory"),
    ("npy_header", ("stage-1-fellow-1/weights.npz: member ", ".npy claims shape (99999999999,) "
                    "of float32 (399999999996 bytes) but holds ")),
    ("compressed", ("stage-1-fellow-1/weights.npz: member ",
                    "is compressed or larger than the archive")),
])
def test_glue_refuses_bad_shards_in_one_line_and_writes_nothing(export_dir, capsys, breakage,
                                                                 message):
    _break_export(export_dir, breakage)
    before = snapshot(export_dir)
    code, err = cli(capsys, "glue", str(export_dir))
    assert code == 1
    one_line(err, "swarm: glue: ", *([message] if isinstance(message, str) else message))
    assert snapshot(export_dir) == before, "nothing written or changed"


def test_glue_checks_counts_before_it_builds_anything(export_dir):
    """The manifest is checked before the stage set is built from its count (the audit's
    10**12 stages took 24 GB); glue then refuses within the test's time and memory."""
    _break_export(export_dir, "num_stages")
    with pytest.raises(GlueError, match=r"\$\.num_stages"):
        glue(export_dir)


# --- eval and generate: the glued model's manifest and weights ---------------------------------


def _break_model(fm: Path, breakage: str) -> None:
    manifest = fm / "inference_manifest.json"
    if breakage == "no_step":
        edit_json(manifest, lambda m: m.pop("step"))
    elif breakage in ("vocab_negative", "vocab_huge"):
        vocab = -1 if breakage == "vocab_negative" else 10**12
        edit_json(manifest, lambda m: m.update(vocab_size=vocab))
    elif breakage == "tokenizer_string":
        edit_json(manifest, lambda m: m.update(tokenizer="byte"))
    elif breakage == "million_ranges":  # built a million stages: 15.7 GB
        edit_json(manifest, lambda m: m.update(stage_ranges=[[0, 1]] * 1_000_000))
    elif breakage == "ranges_gap":
        edit_json(manifest, lambda m: m.update(stage_ranges=[[0, 1], [2, 4]]))
    elif breakage == "ranges_short":
        edit_json(manifest, lambda m: m.update(stage_ranges=[[0, 2], [2, 3]]))
    elif breakage == "ranges_other_split":  # fits the layers, not the weights' stage edges
        edit_json(manifest, lambda m: m.update(stage_ranges=[[0, 4]]))
    elif breakage == "wide_model":
        edit_json(manifest, lambda m: m["model"].update(d_model=16384))
    elif breakage == "manifest_is_dir":
        _replace_with_dir(manifest)
    elif breakage == "npy_header":
        raw = lying_header((fm / "weights.npz").read_bytes(), (99999999999,))
        vouch(manifest, fm / "weights.npz", raw)
    else:
        raise AssertionError(breakage)


@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize("breakage, message", [
    ("no_step", "inference_manifest.json: $.step: required field missing"),
    ("vocab_negative", "inference_manifest.json: $.vocab_size: must be 2..1048576 or null"),
    ("vocab_huge", "inference_manifest.json: $.vocab_size: must be 2..1048576 or null"),
    ("tokenizer_string", "inference_manifest.json: $.tokenizer: expected an object, got a "
                         "string"),
    ("million_ranges", "inference_manifest.json: $.stage_ranges: 1000000 ranges for 4 layers "
                       "(1 to 6)"),
    ("ranges_gap", "inference_manifest.json: $.stage_ranges[1]: expected [1, stop] with stop "
                   "1..4, got [2, 4]"),
    ("ranges_short", "inference_manifest.json: $.stage_ranges: the ranges end at layer 3, not "
                     "at n_layers 4"),
    ("ranges_other_split", "full_model: parameters do not match the model: missing [], "
                           "unexpected ['down.0.norm.bias'"),
    ("wide_model", "weights do not fit the model: size mismatch for embed.tok.weight"),
    ("manifest_is_dir", "inference_manifest.json: cannot read it (Is a directory)"),
    ("npy_header", ("full_model/weights.npz: member ", ".npy claims shape (99999999999,)")),
])
def test_eval_and_generate_refuse_a_bad_model_in_one_line(full_model, capsys, command,
                                                           breakage, message):
    _break_model(full_model, breakage)
    before = snapshot(full_model.parent)
    extra = ["--prompt", "word1", "--tokens", "2"] if command == "generate" else []
    code, err = cli(capsys, command, "--model", str(full_model), *extra)
    assert code == 1
    one_line(err, *([message] if isinstance(message, str) else message))
    assert snapshot(full_model.parent) == before


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path, training, capsys):
    fm = glue(export(tmp_path / "narrow", ranges=RANGES, vocab=40, training=training,
                     tokenizer=BYTE))
    for argv in (["generate", "--prompt", "ab"], ["eval"]):
        code, err = cli(capsys, argv[0], "--model", str(fm), *argv[1:])
        assert code == 1
        one_line(err, "inference_manifest.json: vocab_size 40 is smaller than its tokenizer's "
                      "256 tokens")


# --- flags --------------------------------------------------------------------------------------


def test_eval_batches_are_bounded_by_the_validation_split(full_model, capsys):
    code, err = cli(capsys, "eval", "--model", str(full_model), "--batches", "100000000")
    assert code == 2
    one_line(err, "--batches 100000000: the validation split of textfiles holds ",
             " batch(es) of 2 windows of 8 tokens")
    held = err.split(" holds ")[1].split(" ")[0]
    assert cli(capsys, "eval", "--model", str(full_model), "--batches", held)[0] == 0
    code, err = cli(capsys, "eval", "--model", str(full_model), "--batches", str(int(held) + 1))
    assert code == 2 and f"holds {held} batch(es)" in err


def test_generate_seed_is_what_torch_takes(full_model, capsys):
    gen = ["generate", "--model", str(full_model), "--prompt", "word1", "--tokens", "2"]
    for bad in ("99999999999999999999999", str(2**64), str(-(2**63) - 1)):
        code, err = cli(capsys, *gen, "--seed", bad)
        assert code == 2
        one_line(err, "argument --seed: seed must be >= -9223372036854775808 and <= "
                      "18446744073709551615, got ")
    for good in (str(2**64 - 1), "-1"):
        assert cli(capsys, *gen, "--seed", good)[0] == 0


def test_generate_prompt_must_be_text(full_model, capsys):
    # What Python makes of argv bytes that are not UTF-8 (surrogate escapes).
    code, err = cli(capsys, "generate", "--model", str(full_model), "--prompt", "\udcff\udcfe")
    assert code == 2
    one_line(err, "argument --prompt: not valid UTF-8 text")


def test_generate_prompt_bytes_from_a_real_argv(full_model, cli_env):
    argv = [*swarm_argv("generate", "--model", str(full_model)), "--prompt", b"\xff\xfe"]
    proc = subprocess.run(argv, env=cli_env, capture_output=True, timeout=120)
    assert proc.returncode == 2
    one_line(proc.stderr.decode(errors="replace"), "argument --prompt: not valid UTF-8 text")
