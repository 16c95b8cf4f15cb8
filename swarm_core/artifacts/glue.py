"""Glue stage shards back into one model: ``model_export/full_model/``.

Checks before it builds: each manifest against the model it names (``manifests``), every stage
once, every global layer exactly once, one config fingerprint, one step, and the weights' shapes
against the model's. Then it rebuilds the same ``ExperimentModel`` the stages came from (so the
halves of a learned bottleneck meet again at their boundary), loads the union of the shards
strictly, and writes ``weights.npz`` (no pickles) and ``inference_manifest.json``, and for
other tools the same arrays as ``model.safetensors`` with a ``config.json`` (``export_formats``).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarm_core import jsonio
from swarm_core.artifacts.export_formats import CONFIG, SAFETENSORS, config_json, export_safetensors
from swarm_core.artifacts.layout import MANIFEST, WEIGHTS
from swarm_core.artifacts.manifests import ShardManifest, model_manifest, shard_manifest
from swarm_core.artifacts.shards import ShardError, load_shard, npz_arrays, npz_bytes, read_file
from swarm_core.config.schemas import ModelConfig
from swarm_core.paths import atomic_write
from swarm_core.pipeline.whole import ExperimentModel
from swarm_core.schema import SchemaError

FULL_MODEL = "full_model"
INFERENCE_MANIFEST = "inference_manifest.json"


class GlueError(ValueError):
    pass


def _shard_dirs(export_dir: Path) -> list[Path]:
    root = export_dir / "shards"
    if not root.is_dir():
        raise GlueError(f"{export_dir}: no shards/ directory (is this a model_export dir?)")
    dirs = sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))
    if not dirs:
        raise GlueError(f"{root}: no shard manifests")
    return dirs


def check_shards(manifests: list[ShardManifest], n_layers: int) -> list[tuple[int, int]]:
    """The stage layer ranges, or a GlueError saying what is missing or inconsistent."""
    by_stage: dict[int, ShardManifest] = {}
    jobs = {m.job_id for m in manifests}
    if len(jobs) != 1:
        raise GlueError(f"shards come from different jobs ({', '.join(sorted(jobs))}): glue "
                        "one job's shards")
    for m in manifests:
        if m.stage in by_stage:
            raise GlueError(f"stage {m.stage} appears twice (fellows "
                            f"{by_stage[m.stage].fellow_id} and {m.fellow_id})")
        by_stage[m.stage] = m
    num = {m.num_stages for m in manifests}
    if len(num) != 1:
        raise GlueError(f"shards disagree on the number of stages: {sorted(num)}")
    (n,) = num
    missing = sorted(set(range(n)) - set(by_stage))
    if missing:
        raise GlueError(f"missing stage(s) {missing} of {n} (have {sorted(by_stage)})")
    prints = {m.config_fingerprint for m in manifests}
    if len(prints) != 1:
        detail = ", ".join(f"stage {s}: {by_stage[s].config_fingerprint[:8]}"
                           for s in sorted(by_stage))
        raise GlueError(f"config fingerprints differ ({detail}): shards of different models")
    steps = {m.step for m in manifests}
    if len(steps) != 1:
        detail = ", ".join(f"stage {s} at {by_stage[s].step}" for s in sorted(by_stage))
        raise GlueError(f"shards come from different steps ({detail})")
    owner: dict[int, int] = {}
    ranges = []
    for s in range(n):
        start, stop = by_stage[s].layers.start, by_stage[s].layers.stop
        for layer in range(start, stop):
            if layer in owner:
                raise GlueError(f"layer {layer} is held by stage {owner[layer]} and stage {s}")
            owner[layer] = s
        ranges.append((start, stop))
    gaps = [i for i in range(n_layers) if i not in owner]
    if gaps:
        raise GlueError(f"no shard holds layer(s) {gaps}")
    extra = [i for i in owner if i >= n_layers]
    if extra:
        raise GlueError(f"shards hold layer(s) {extra} beyond n_layers={n_layers}")
    if [r[0] for r in ranges] != sorted(r[0] for r in ranges):
        raise GlueError("stage layer ranges are out of order")
    return ranges


def _check_output(out: Path) -> None:
    """Found before the work, not half way through writing it."""
    if out.exists() and not out.is_dir():
        raise GlueError(f"{out} exists and is not a directory")
    for name in (WEIGHTS, INFERENCE_MANIFEST, SAFETENSORS, CONFIG):
        if (out / name).is_dir():
            raise GlueError(f"{out / name} is a directory")


def glue(export_dir: Path) -> Path:
    dirs = _shard_dirs(export_dir)
    out = export_dir / FULL_MODEL
    _check_output(out)
    manifests, cfgs, shard_arrays = [], [], []
    for d in dirs:
        try:
            data, arrays = load_shard(d)
            m, cfg = shard_manifest(data)
        except ShardError as exc:
            raise GlueError(str(exc)) from None
        except SchemaError as exc:
            raise GlueError(f"{d / MANIFEST}: {exc}") from None
        manifests.append(m)
        cfgs.append(cfg)
        shard_arrays.append(arrays)
    first, cfg = min(zip(manifests, cfgs, strict=True), key=lambda x: x[0].stage)
    ranges = check_shards(manifests, cfg.n_layers)
    state: dict[str, torch.Tensor] = {}
    holder: dict[str, int] = {}
    for m, arrays in zip(manifests, shard_arrays, strict=True):
        for k, v in arrays.items():
            if k in state:
                raise GlueError(f"parameter {k} is in the shards of stage {holder[k]} and "
                                f"stage {m.stage}")
            state[k], holder[k] = torch.from_numpy(np.array(v)), m.stage
    model = _build(cfg, first.vocab_size, first.seed, ranges, state, str(export_dir))
    arrays = {k: v.numpy() for k, v in model.flat_state_dict().items()}
    weights = npz_bytes(arrays)
    manifest = {
        "format": "silentswarm-model/1",
        "job_id": first.job_id,
        "step": first.step,
        "config_fingerprint": first.config_fingerprint,
        "model": first.model,
        "training": first.training,
        "seed": first.seed,
        "vocab_size": first.vocab_size,
        "tokenizer": first.tokenizer,
        "stage_ranges": [list(r) for r in ranges],
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "sources": [{"stage": m.stage, "fellow_id": m.fellow_id,
                     "dir": str(d.relative_to(export_dir)),
                     "weights_sha256": m.weights_sha256}
                    for d, m in sorted(zip(dirs, manifests, strict=True),
                                       key=lambda x: x[1].stage)],
        "glued_at": time.time(),
    }
    tensors = export_safetensors(arrays, manifest)
    tensors_sha256 = hashlib.sha256(tensors).hexdigest()
    manifest["safetensors_sha256"] = tensors_sha256
    config = config_json(cfg, manifest, tensors_sha256)
    # Each manifest after its weights, and older ones gone first: a manifest (or config.json)
    # on disk always means the weights beside it are its own, even if this write stops
    # part-way (a disk full).
    try:
        (out / INFERENCE_MANIFEST).unlink(missing_ok=True)
        (out / CONFIG).unlink(missing_ok=True)
        atomic_write(out / WEIGHTS, weights)
        atomic_write(out / SAFETENSORS, tensors)
        atomic_write(out / CONFIG, jsonio.dumps(config, pretty=True))
        atomic_write(out / INFERENCE_MANIFEST, jsonio.dumps(manifest, pretty=True))
    except OSError as exc:
        raise GlueError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out


def _build(cfg: ModelConfig, vocab: int, seed: int, ranges: list[tuple[int, int]],
           state: dict[str, torch.Tensor], where: str) -> ExperimentModel:
    """The model the manifest describes, with ``state`` loaded. The manifest sizes the model,
    so the weights, whose size is real, must fit it on the meta device (which allocates
    nothing) before it is built."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in
                  ExperimentModel(cfg, vocab, seed, ranges).flat_state_dict().items()}
    if set(state) != set(shapes):
        missing = sorted(set(shapes) - set(state))[:3]
        unknown = sorted(set(state) - set(shapes))[:3]
        raise GlueError(f"{where}: parameters do not match the model: missing {missing}, "
                        f"unexpected {unknown}")
    for k, shape in shapes.items():
        if tuple(state[k].shape) != shape:
            raise GlueError(f"{where}: weights do not fit the model: size mismatch for {k}: "
                            f"{list(state[k].shape)} in the weights, {list(shape)} in the model")
    model = ExperimentModel(cfg, vocab, seed, ranges)
    for stage_module in model.stages:
        try:
            stage_module.load_state_dict({k: state[k] for k in stage_module.state_dict()},
                                         strict=True)
        except RuntimeError as exc:  # e.g. a dtype torch cannot copy: the last line names it
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            raise GlueError(f"{where}: weights do not fit the model: "
                            f"{lines[-1] if lines else exc}") from None
    return model


def load_full_model(model_dir: Path) -> tuple[ExperimentModel, dict[str, Any]]:
    """The glued model, ready for inference, and its manifest (the fields eval and generate use
    checked by ``manifests.model_manifest``); weights load with ``allow_pickle=False``."""
    path = model_dir / INFERENCE_MANIFEST
    hint = " (run the glue step)"
    try:
        text = read_file(model_dir, INFERENCE_MANIFEST, hint)
        raw = read_file(model_dir, WEIGHTS, hint)
    except ShardError as exc:
        raise GlueError(str(exc)) from None
    try:
        manifest = jsonio.loads(text)
    except jsonio.JSONDecodeError as exc:
        raise GlueError(f"{path}: not valid JSON: {exc}") from None
    try:
        m, cfg = model_manifest(manifest)
    except SchemaError as exc:
        raise GlueError(f"{path}: {exc}") from None
    if hashlib.sha256(raw).hexdigest() != m.weights_sha256:
        raise GlueError(f"{model_dir}: weights.npz does not match its manifest")
    try:
        state = {k: torch.from_numpy(v) for k, v in npz_arrays(raw).items()}
    except ShardError as exc:
        raise GlueError(f"{model_dir / WEIGHTS}: {exc}") from None
    ranges = [(a, b) for a, b in m.stage_ranges]
    model = _build(cfg, m.vocab_size, m.seed, ranges, state, str(model_dir))
    model.eval()
    return model, manifest


def full_model_dir(path: Path) -> Path:
    """The glued model a path names: a run's ``model_export`` directory (its ``full_model/``)
    or the ``full_model`` directory itself; anything else is a one-line GlueError."""
    try:
        if not path.exists():
            raise GlueError(f"{path}: no such directory")
        if not path.is_dir():
            raise GlueError(f"{path} is not a directory")
        if (path / FULL_MODEL).is_dir():
            return path / FULL_MODEL
        if path.name == FULL_MODEL or (path / INFERENCE_MANIFEST).exists() \
                or (path / WEIGHTS).exists():
            return path  # (load_full_model says what of it is missing or wrong)
        if (path / "shards").is_dir():
            raise GlueError(f"{path}: not glued yet (run `swarm glue {path}`)")
    except OSError as exc:  # (exists() raises on a directory we may not search)
        raise GlueError(f"cannot look at {path}: {exc.strerror or exc}") from None
    raise GlueError(f"{path}: not a model export (no {FULL_MODEL}/ or {INFERENCE_MANIFEST} in "
                    "it)")
