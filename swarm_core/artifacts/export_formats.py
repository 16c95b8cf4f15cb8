"""The glued model's files for other tools, beside ``weights.npz``: ``model.safetensors`` (the
same arrays, under the same names) and ``config.json`` (what rebuilds the model around them).

The module names are SilentSwarm's own (``blocks.0.attn.qkv.weight``, a bottleneck's
``down.K``/``up.K`` halves), not a ``transformers`` architecture's, so ``config.json`` says
``"format": "silentswarm-gpt"`` and ``transformers.AutoModel`` will not load it; the
safetensors file opens anywhere (``safetensors.numpy.load_file``, ``safe_open``), and
``swarm_core.pipeline.whole.ExperimentModel`` rebuilt from ``config.json`` takes its arrays.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from swarm_core.artifacts.safetensors_file import safetensors_bytes
from swarm_core.config.schemas import ModelConfig
from swarm_core.schema import structure, unstructure

SAFETENSORS = "model.safetensors"
CONFIG = "config.json"
FORMAT = "silentswarm-gpt"
FORMAT_VERSION = 1
MODEL_FIELDS = tuple(f.name for f in attrs.fields(ModelConfig))


def export_safetensors(arrays: dict[str, np.ndarray], manifest: dict[str, Any]) -> bytes:
    """The weights as safetensors; the metadata (strings only, by the format) says what they
    are and where the config is."""
    return safetensors_bytes(arrays, {"format": FORMAT, "config": CONFIG,
                                      "job_id": str(manifest["job_id"]),
                                      "step": str(manifest["step"])})


def config_json(cfg: ModelConfig, manifest: dict[str, Any],
                safetensors_sha256: str) -> dict[str, Any]:
    """``config.json``: the ModelConfig's fields at the top level (as Hugging Face configs
    keep theirs) with ``vocab_size`` the model's real one, then what ``ExperimentModel`` needs
    besides (the init seed, the stage ranges, whose edges name a bottleneck's halves) and the
    tokenizer that maps text to its ids."""
    model = unstructure(attrs.evolve(cfg, vocab_size=manifest["vocab_size"]))
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_type": FORMAT,  # not a transformers model type: see the module's docstring
        "architectures": ["ExperimentModel"],  # swarm_core.pipeline.whole
        **model,
        "seed": manifest["seed"],
        "stage_ranges": [list(r) for r in manifest["stage_ranges"]],
        "tokenizer": manifest.get("tokenizer"),
        "weights": SAFETENSORS,
        "weights_sha256": safetensors_sha256,
        "job_id": manifest["job_id"],
        "step": manifest["step"],
        "config_fingerprint": manifest["config_fingerprint"],
    }


def model_config(config: dict[str, Any]) -> ModelConfig:
    """The ModelConfig a ``config.json`` holds (a SchemaError naming the field if it is not
    one): ``ExperimentModel(cfg, cfg.vocab_size, config["seed"], config["stage_ranges"])``
    is the glued model's shape."""
    return structure({k: config[k] for k in MODEL_FIELDS if k in config}, ModelConfig)
