"""Glue stage shards back into one model: ``model_export/full_model/``.

Checks before it builds: every stage once, every global layer exactly once, one config
fingerprint, one step. Then it rebuilds the same ``ExperimentModel`` the stages came from (so the
halves of a learned bottleneck meet again at their boundary), loads the union of the shards
strictly, and writes ``weights.npz`` (no pickles) and ``inference_manifest.json``.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarm_core import jsonio
from swarm_core.artifacts.shards import MANIFEST, ShardError, load_shard, npz_arrays, npz_bytes
from swarm_core.config.schemas import ModelConfig
from swarm_core.paths import atomic_write
from swarm_core.pipeline.model import ExperimentModel
from swarm_core.schema import SchemaError, structure

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


# What glue reads from each shard manifest, and from a glued model's manifest, by type.
_SHARD_FIELDS: dict[str, type] = {
    "job_id": str, "stage": int, "num_stages": int, "fellow_id": int, "step": int,
    "config_fingerprint": str, "layers": dict, "model": dict, "vocab_size": int, "seed": int,
}
_MODEL_FIELDS: dict[str, type] = {
    "weights_sha256": str, "model": dict, "vocab_size": int, "seed": int, "stage_ranges": list,
}


def _check_fields(m: dict[str, Any], fields: dict[str, type], where: str) -> None:
    for key, kind in fields.items():
        v = m.get(key)
        if v is None:
            raise GlueError(f"{where}: no {key}")
        if not isinstance(v, kind) or isinstance(v, bool):
            raise GlueError(f"{where}: {key} is {v!r}, not {kind.__name__}")


def check_shards(manifests: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The stage layer ranges, or a GlueError saying what is missing or inconsistent."""
    by_stage: dict[int, dict[str, Any]] = {}
    jobs = {m["job_id"] for m in manifests}
    if len(jobs) != 1:
        raise GlueError(f"shards come from different jobs ({', '.join(sorted(jobs))}): glue "
                        "one job's shards")
    for m in manifests:
        stage = m["stage"]
        if stage in by_stage:
            raise GlueError(f"stage {stage} appears twice (fellows {by_stage[stage]['fellow_id']} "
                            f"and {m['fellow_id']})")
        by_stage[stage] = m
    num = {m["num_stages"] for m in manifests}
    if len(num) != 1:
        raise GlueError(f"shards disagree on the number of stages: {sorted(num)}")
    (n,) = num
    missing = sorted(set(range(n)) - set(by_stage))
    if missing:
        raise GlueError(f"missing stage(s) {missing} of {n} (have {sorted(by_stage)})")
    prints = {m["config_fingerprint"] for m in manifests}
    if len(prints) != 1:
        detail = ", ".join(f"stage {s}: {by_stage[s]['config_fingerprint'][:8]}"
                           for s in sorted(by_stage))
        raise GlueError(f"config fingerprints differ ({detail}): shards of different models")
    steps = {m["step"] for m in manifests}
    if len(steps) != 1:
        detail = ", ".join(f"stage {s} at {by_stage[s]['step']}" for s in sorted(by_stage))
        raise GlueError(f"shards come from different steps ({detail})")
    n_layers = by_stage[0]["model"].get("n_layers")
    owner: dict[int, int] = {}
    ranges = []
    for s in range(n):
        start, stop = by_stage[s]["layers"]["start"], by_stage[s]["layers"]["stop"]
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


def glue(export_dir: Path) -> Path:
    dirs = _shard_dirs(export_dir)
    loaded = []
    for d in dirs:
        try:
            loaded.append(load_shard(d))
        except ShardError as exc:
            raise GlueError(str(exc)) from None
    manifests = [m for m, _ in loaded]
    for d, m in zip(dirs, manifests, strict=True):
        _check_fields(m, _SHARD_FIELDS, str(d / MANIFEST))
        if not all(isinstance(m["layers"].get(k), int) for k in ("start", "stop")):
            raise GlueError(f"{d / MANIFEST}: layers must have integer start and stop")
    ranges = check_shards(manifests)
    first = min(manifests, key=lambda m: m["stage"])
    try:
        model_cfg = structure(first["model"], ModelConfig)
    except SchemaError as exc:
        raise GlueError(f"shard model config is invalid: {exc}") from None
    model = ExperimentModel(model_cfg, first["vocab_size"], first["seed"], ranges)
    state: dict[str, torch.Tensor] = {}
    holder: dict[str, int] = {}
    for m, arrays in loaded:
        for k, v in arrays.items():
            if k in state:
                raise GlueError(f"parameter {k} is in the shards of stage {holder[k]} and "
                                f"stage {m['stage']}")
            state[k], holder[k] = torch.from_numpy(np.array(v)), m["stage"]
    expected = set(model.flat_state_dict())
    if set(state) != expected:
        missing = sorted(expected - set(state))[:3]
        unknown = sorted(set(state) - expected)[:3]
        raise GlueError(f"shard parameters do not match the model: missing {missing}, "
                        f"unexpected {unknown}")
    _load_stages(model, state, str(export_dir))
    out = export_dir / FULL_MODEL
    weights = npz_bytes({k: v.numpy() for k, v in model.flat_state_dict().items()})
    atomic_write(out / "weights.npz", weights)
    manifest = {
        "format": "silentswarm-model/1",
        "job_id": first["job_id"],
        "step": first["step"],
        "config_fingerprint": first["config_fingerprint"],
        "model": first["model"],
        "training": first.get("training"),
        "seed": first["seed"],
        "vocab_size": first["vocab_size"],
        "tokenizer": first["tokenizer"],
        "stage_ranges": [list(r) for r in ranges],
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "sources": [{"stage": m["stage"], "fellow_id": m["fellow_id"],
                     "dir": str(d.relative_to(export_dir)),
                     "weights_sha256": m["weights_sha256"]}
                    for d, m in sorted(zip(dirs, manifests, strict=True),
                                       key=lambda x: x[1]["stage"])],
        "glued_at": time.time(),
    }
    atomic_write(out / INFERENCE_MANIFEST, jsonio.dumps(manifest, pretty=True))
    return out


def _load_stages(model: ExperimentModel, state: dict[str, torch.Tensor], where: str) -> None:
    for stage_module in model.stages:
        try:
            stage_module.load_state_dict({k: state[k] for k in stage_module.state_dict()},
                                         strict=True)
        except KeyError as exc:
            raise GlueError(f"{where}: the weights lack {exc.args[0]}") from None
        except RuntimeError as exc:  # wrong shapes: the first complaint names the tensor
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            raise GlueError(f"{where}: weights do not fit the model: "
                            f"{lines[-1] if lines else exc}") from None


def load_full_model(model_dir: Path) -> tuple[ExperimentModel, dict[str, Any]]:
    """The glued model, ready for inference; weights load with ``allow_pickle=False``."""
    path = model_dir / INFERENCE_MANIFEST
    try:
        manifest = jsonio.loads(path.read_bytes())
        raw = (model_dir / "weights.npz").read_bytes()
    except FileNotFoundError as exc:
        raise GlueError(f"{model_dir}: missing {Path(exc.filename).name} (run the glue step)") \
            from None
    except jsonio.JSONDecodeError as exc:
        raise GlueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise GlueError(f"{path}: not a JSON object")
    _check_fields(manifest, _MODEL_FIELDS, str(path))
    if hashlib.sha256(raw).hexdigest() != manifest["weights_sha256"]:
        raise GlueError(f"{model_dir}: weights.npz does not match its manifest")
    try:
        state = {k: torch.from_numpy(v) for k, v in npz_arrays(raw).items()}
    except ShardError as exc:
        raise GlueError(f"{model_dir / 'weights.npz'}: {exc}") from None
    try:
        cfg = structure(manifest["model"], ModelConfig)
    except SchemaError as exc:
        raise GlueError(f"{path}: model: {exc}") from None
    ranges = manifest["stage_ranges"]
    if not all(isinstance(r, list) and len(r) == 2 and all(isinstance(i, int) for i in r)
               for r in ranges):
        raise GlueError(f"{path}: stage_ranges must be [start, stop] pairs of integers")
    try:
        model = ExperimentModel(cfg, manifest["vocab_size"], manifest["seed"],
                                [tuple(r) for r in ranges])
    except (ValueError, IndexError) as exc:
        raise GlueError(f"{path}: stage_ranges {ranges} do not fit the model: {exc}") from None
    _load_stages(model, state, str(model_dir))
    model.eval()
    return model, manifest
