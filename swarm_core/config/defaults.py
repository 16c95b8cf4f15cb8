"""The embedded default job: what ``swarm quickstart`` trains with no config files at hand.

Mirrors ``exp/configs/model/small_none.json`` and
``exp/configs/training/quickstart_shakespeare.json`` (a test keeps them equal).
"""

from __future__ import annotations

from typing import Any

DEFAULT_MODEL: dict[str, Any] = {
    "name": "small_none",
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "seq_len": 64,
    "dropout": 0.0,
    "dtype": "float32",
    "compression": "none",
    "wire_dtype": "fp32",
}

DEFAULT_TRAINING: dict[str, Any] = {
    "name": "quickstart_shakespeare",
    "dataset": "shakespeare",
    "tokenizer": "byte",
    "seed": 0,
    "steps": 40,
    "batch_size": 16,
    "micro_batches": 4,
    "schedule": "1f1b",
    "lr": 0.003,
    "min_lr": 0.0003,
    "warmup_steps": 5,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "eval_every": 20,
    "eval_batches": 4,
    "real_min_tokens": 1000000,
}
