"""Stage shards: ``stage-K-fellow-F/{shard_manifest.json,weights.npz,optimizer.npz}``.

Weights are plain ``.npy`` members of an ``.npz`` (no pickles; they load with
``allow_pickle=False``), named by global parameter names, so shards glue back by union. The
manifest says which global layers and edge parts the shard holds, at which step, and the config
fingerprint that all shards of one model must share.

``optimizer.npz`` holds the stage's optimiser state (``<parameter>.<field>``, see
``pipeline.optim.optimizer_arrays``), so that a run resumed from pushed shards continues exactly
as the uninterrupted run would. Gluing and inference read only the weights.
"""

from __future__ import annotations

import hashlib
import io
import math
import time
import zipfile
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from swarm_core import jsonio
from swarm_core.artifacts.layout import (  # noqa: F401  (shard_dir_name, write_shard: re-exported)
    MANIFEST,
    OPTIMIZER,
    WEIGHTS,
    names_optimizer,
    shard_dir_name,
    write_shard,
)

FORMAT = "silentswarm-shard/1"


def config_fingerprint(model: dict[str, Any], seed: int, vocab_size: int) -> str:
    """Same architecture, init seed and vocabulary: shards of one model share this."""
    arch = {k: v for k, v in model.items() if k != "name"}
    blob = jsonio.dumps({"model": arch, "seed": seed, "vocab_size": vocab_size})
    return hashlib.sha256(blob).hexdigest()[:32]


def state_arrays(module: torch.nn.Module) -> dict[str, np.ndarray]:
    out = {}
    for name, t in module.state_dict().items():
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)  # numpy has no bfloat16
        out[name] = t.numpy().copy()
    return out


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    # (Any: numpy's stubs read **arrays as maybe holding its allow_pickle flag, which numpy
    # 1.26, still supported, does not take and would store as an array)
    np.savez(buf, **cast(dict[str, Any], arrays))
    return buf.getvalue()


def build_manifest(*, job_id: str, stage: int, num_stages: int, fellow_id: int,
                   fellow_name: str, layers: tuple[int, int], step: int, model: dict[str, Any],
                   seed: int, vocab_size: int, tokenizer: dict[str, Any],
                   arrays: dict[str, np.ndarray], weights: bytes,
                   slot: int = 0, device: str = "cpu",
                   training: dict[str, Any] | None = None,
                   optimizer: bytes | None = None, replica: int = 0,
                   replica_states: tuple[int, ...] = ()) -> dict[str, Any]:
    """A stage shard's manifest. ``replica``: the member that wrote it; ``replica_states``:
    the other replicas whose own optimiser states (DiLoCo) belong with this checkpoint."""
    return {
        "format": FORMAT,
        "job_id": job_id,
        "stage": stage,
        "num_stages": num_stages,
        "fellow_id": fellow_id,
        "fellow_name": fellow_name,
        "slot": slot,
        "device": device,
        "layers": {"start": layers[0], "stop": layers[1]},
        "has_embedding": stage == 0,
        "has_head": stage == num_stages - 1,
        "step": step,
        "config_fingerprint": config_fingerprint(model, seed, vocab_size),
        "model": model,
        "training": training,
        "seed": seed,
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "params": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in arrays.items()},
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "weights_bytes": len(weights),
        "optimizer_sha256": None if optimizer is None else hashlib.sha256(optimizer).hexdigest(),
        "optimizer_bytes": None if optimizer is None else len(optimizer),
        "replica": replica,
        "replica_states": list(replica_states),
        "created_at": time.time(),
    }


def param_shapes(module: torch.nn.Module) -> dict[str, Any]:
    """A manifest's ``params`` of a module, without copying its weights."""
    return {k: {"shape": list(v.shape),
                "dtype": "float32" if v.dtype == torch.bfloat16
                else str(v.dtype).removeprefix("torch.")}
            for k, v in module.state_dict().items()}


def replica_state_manifest(*, job_id: str, stage: int, fellow_id: int, replica: int,
                           step: int, model: dict[str, Any], seed: int, vocab_size: int,
                           params: dict[str, Any], optimizer: bytes) -> dict[str, Any]:
    """The manifest of one replica's own optimiser state at a checkpoint (DiLoCo): no weights
    (they are the stage shard's), the optimiser archive by its sha256."""
    return {
        "format": FORMAT,
        "job_id": job_id,
        "stage": stage,
        "fellow_id": fellow_id,
        "replica": replica,
        "step": step,
        "config_fingerprint": config_fingerprint(model, seed, vocab_size),
        "params": params,
        "weights_sha256": None,
        "weights_bytes": None,
        "optimizer_sha256": hashlib.sha256(optimizer).hexdigest(),
        "optimizer_bytes": len(optimizer),
        "created_at": time.time(),
    }


class ShardError(ValueError):
    pass


def _matches(raw: bytes, manifest: dict[str, Any], part: str) -> bool:
    """``raw`` is the file the manifest names as ``<part>_sha256``."""
    return hashlib.sha256(raw).hexdigest() == manifest.get(f"{part}_sha256")


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}


def _check_members(raw: bytes) -> None:
    """Each member is a stored ``.npy`` whose header describes the bytes it holds. numpy
    allocates the shape a header claims before it reads the data, so a header of a few bytes
    could ask for any amount of memory; stored (not compressed) members cannot hold more than
    the archive, and a header that matches its member cannot claim more than that."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        for info in z.infolist():
            name = info.filename
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(raw):
                raise ShardError(f"member {name} is compressed or larger than the archive; only "
                                 "stored .npy members load")
            with z.open(info) as fh:
                read_header = _NPY_HEADERS.get(np.lib.format.read_magic(fh))
                if read_header is None:
                    raise ShardError(f"member {name} is not a version 1 or 2 .npy array")
                shape, _, dtype = read_header(fh)
                if dtype.hasobject:
                    raise ShardError("an array holds pickled objects; only plain arrays load")
                claimed = math.prod(shape) * dtype.itemsize
                held = info.file_size - fh.tell()
            if claimed != held:
                raise ShardError(f"member {name} claims shape {shape} of {dtype} "
                                 f"({claimed} bytes) but holds {held} bytes")


def npz_arrays(raw: bytes) -> dict[str, np.ndarray]:
    """The arrays of :func:`npz_bytes`' output (plain ``.npy`` members only: no pickles);
    anything else is a :class:`ShardError`."""
    if not raw.startswith(b"PK"):  # numpy would try the bytes as a pickle, and say so
        raise ShardError("not an .npz archive")
    try:
        _check_members(raw)
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            return {k: np.array(z[k]) for k in z.files}
    except ShardError:
        raise
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ShardError("an array holds pickled objects; only plain arrays load") \
                from None
        raise ShardError(f"not a valid .npz archive: {exc}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ShardError(f"not a valid .npz archive: {exc}") from None


def weights_from_checkpoint(manifest: dict[str, Any], weights: bytes) -> dict[str, torch.Tensor]:
    """State dict from a fetched checkpoint, after checking it is the one the manifest names."""
    if not _matches(weights, manifest, "weights"):
        raise ShardError("checkpoint weights do not match their manifest's sha256")
    return {k: torch.from_numpy(v) for k, v in npz_arrays(weights).items()}


def optimizer_from_checkpoint(manifest: dict[str, Any],
                              optimizer: bytes | None) -> dict[str, np.ndarray] | None:
    """The optimiser state arrays a checkpoint carries (None for a checkpoint without them),
    after checking they are the ones its manifest names."""
    if not names_optimizer(manifest):
        if optimizer is not None:
            raise ShardError("checkpoint has optimiser state its manifest does not name")
        return None
    if optimizer is None:
        raise ShardError("checkpoint manifest names optimiser state that did not come")
    if not _matches(optimizer, manifest, "optimizer"):
        raise ShardError("checkpoint optimiser state does not match its manifest's sha256")
    return npz_arrays(optimizer)


def read_file(d: Path, name: str, hint: str = "") -> bytes:
    """``d/name``'s bytes; missing, a directory or unreadable is a one-line ShardError (with
    ``hint`` after "missing")."""
    try:
        return (d / name).read_bytes()
    except FileNotFoundError:
        raise ShardError(f"{d}: missing {name}{hint}") from None
    except OSError as exc:
        raise ShardError(f"{d / name}: cannot read it ({exc.strerror or exc})") from None


def load_shard(d: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    text, raw = read_file(d, MANIFEST), read_file(d, WEIGHTS)
    try:
        manifest = jsonio.loads(text)
    except jsonio.JSONDecodeError as exc:
        raise ShardError(f"{d / MANIFEST}: not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise ShardError(f"{d / MANIFEST}: not a JSON object")
    if not isinstance(manifest.get("weights_sha256"), str):
        raise ShardError(f"{d / MANIFEST}: no weights_sha256 to check weights.npz against")
    if not _matches(raw, manifest, "weights"):
        raise ShardError(f"{d}: weights.npz does not match the manifest's sha256")
    try:
        return manifest, npz_arrays(raw)
    except ShardError as exc:
        raise ShardError(f"{d / WEIGHTS}: {exc}") from None
