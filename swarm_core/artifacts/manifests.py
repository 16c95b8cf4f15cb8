"""What glue reads from a stage shard's manifest, and eval and generate from a glued model's.

No checksum covers a manifest, and its numbers size what is built from it: stages, layers, the
vocabulary. So each is checked here, once, against the model it describes before anything is
built, and a bad one is a :class:`~swarm_core.schema.SchemaError` naming its JSON path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from swarm_core.config.schemas import ModelConfig
from swarm_core.schema import FieldError, SchemaError, checking, structure
from swarm_core.validators import MAX_BYTES, MAX_STEPS


def _at_least(lo: int) -> Callable[[Any, attrs.Attribute, int], None]:
    def check(_inst: Any, attr: attrs.Attribute, value: int) -> None:
        if value < lo:
            raise FieldError(f"must be >= {lo}, got {value}", attr.name)

    return check


@attrs.define
class LayerRange:
    start: int = attrs.field(validator=_at_least(0))
    stop: int = attrs.field(validator=_at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.stop < self.start:
            raise FieldError(f"{self.stop} is before start {self.start}", "stop")


def _byte_count(_inst: Any, attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_BYTES:
        raise FieldError(f"must be a byte count (0 to 2**44) or null, got {value}", attr.name)


def _no_later_than_any_job(_inst: Any, attr: attrs.Attribute, value: int) -> None:
    # (the leader then holds a pushed one to its job's own steps)
    if value > MAX_STEPS:
        raise FieldError(f"must be at most {MAX_STEPS} (no job trains longer), got {value}",
                         attr.name)


@attrs.define
class ShardManifest:
    """A stage shard's ``shard_manifest.json`` (``artifacts.shards.build_manifest`` writes it):
    what the leader checks a push against and glue builds the model from. Structured leniently
    (a key this version does not know is passed over, and stays in the file); a field a
    manifest from an older fellow lacks takes its default."""

    job_id: str
    stage: int = attrs.field(validator=_at_least(0))
    num_stages: int = attrs.field(validator=_at_least(1))
    fellow_id: int
    step: int = attrs.field(validator=[_at_least(0), _no_later_than_any_job])
    config_fingerprint: str
    layers: LayerRange
    model: dict[str, Any]
    vocab_size: int
    seed: int
    weights_sha256: str
    tokenizer: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    format: str | None = None
    fellow_name: str | None = None
    slot: int = 0
    device: str | None = None
    has_embedding: bool | None = None
    has_head: bool | None = None
    # {parameter name: {shape, dtype}}: the members the weights archive must hold
    params: dict[str, Any] = attrs.field(factory=dict)
    weights_bytes: int | None = attrs.field(default=None, validator=_byte_count)
    # The optimiser state pushed with the weights (a manifest from before it names none).
    optimizer_sha256: str | None = None
    optimizer_bytes: int | None = attrs.field(default=None, validator=_byte_count)
    # The replica that wrote it, and (DiLoCo) the other replicas whose own optimiser states
    # belong with this checkpoint.
    replica: int = attrs.field(default=0, validator=_at_least(0))
    replica_states: list[int] = attrs.field(factory=list)
    created_at: float | None = None
    received_at: float | None = None  # the leader's, once the push is in

    def __attrs_post_init__(self) -> None:
        if not checking():  # (what the leader wrote itself, checked as it came in)
            return
        if self.stage >= self.num_stages:
            raise FieldError(f"{self.stage} is not below num_stages {self.num_stages}", "stage")
        if any(r < 0 for r in self.replica_states) or \
                len(set(self.replica_states)) != len(self.replica_states) or \
                self.replica in self.replica_states:
            raise FieldError("must list other replicas, each once", "replica_states")

    @property
    def names_optimizer(self) -> bool:
        return self.optimizer_sha256 is not None


@attrs.define
class ReplicaStateManifest:
    """One replica's own optimiser state at a checkpoint (DiLoCo; ``artifacts.shards.
    replica_state_manifest`` writes it): no weights, which are its stage shard's, so its
    ``weights_sha256`` is null. Structured leniently, as ShardManifest is."""

    job_id: str
    stage: int = attrs.field(validator=_at_least(0))
    fellow_id: int
    replica: int = attrs.field(validator=_at_least(0))
    step: int = attrs.field(validator=[_at_least(0), _no_later_than_any_job])
    optimizer_sha256: str
    optimizer_bytes: int | None = attrs.field(default=None, validator=_byte_count)
    config_fingerprint: str | None = None
    params: dict[str, Any] = attrs.field(factory=dict)
    format: str | None = None
    created_at: float | None = None
    received_at: float | None = None  # the leader's, once the push is in

    @property
    def names_optimizer(self) -> bool:
        return True


PushedManifest = ShardManifest | ReplicaStateManifest


def pushed_manifest(data: Any, root: str = "$") -> PushedManifest:
    """A manifest as a fellow pushes it: a stage shard's, or (no ``weights_sha256``) one
    replica's own optimiser state; a SchemaError names the field at fault under ``root``."""
    if not isinstance(data, dict):
        raise SchemaError("expected an object", root)
    if data.get("weights_sha256") is None:
        try:
            return structure(data, ReplicaStateManifest, root, strict=False)
        except SchemaError as exc:
            # (else a stage shard's manifest that lost its weights_sha256 reads as a riddle)
            raise SchemaError(f"{exc.message} (no weights_sha256: read as a replica's own "
                              "optimiser state)", exc.field) from None
    return structure(data, ShardManifest, root, strict=False)


@attrs.define
class ModelManifest:
    """The fields of ``inference_manifest.json`` that eval and generate use."""

    step: int = attrs.field(validator=_at_least(0))
    model: dict[str, Any]
    vocab_size: int
    seed: int
    stage_ranges: list[list[int]]
    weights_sha256: str
    tokenizer: dict[str, Any] | None = None
    training: dict[str, Any] | None = None


def _max_stages(cfg: ModelConfig) -> int:
    # The leader's rule (config.schemas.job_shape_error): no job has more stages than this.
    return cfg.n_layers + 2


def _model(data: Any) -> ModelConfig:
    """The manifest's model, strictly (an unknown key may change the architecture), and its
    vocabulary within the bound ModelConfig sets."""
    if not isinstance(data, dict):
        raise SchemaError("expected an object", "$")
    if "model" not in data:
        raise SchemaError("required field missing", "$.model")
    model = data["model"]
    if isinstance(model, dict) and "init" not in model:
        # Written before the init was recorded: trained under PyTorch's defaults. (Glue and
        # eval load the weights whatever the init; this keeps what the export says true.)
        model = {**model, "init": "torch"}
    cfg = structure(model, ModelConfig, root="$.model")
    vocab = data.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        try:  # ModelConfig holds the bound on a vocabulary
            attrs.evolve(cfg, vocab_size=vocab)
        except FieldError as exc:
            raise SchemaError(str(exc), "$.vocab_size") from None
    return cfg


def shard_manifest(data: Any) -> tuple[ShardManifest, ModelConfig]:
    """A shard manifest whose stage and layers fit the model it names, or a SchemaError."""
    cfg = _model(data)
    m = structure(data, ShardManifest, strict=False)
    if m.num_stages > _max_stages(cfg):
        raise SchemaError(f"{m.num_stages} stages for {cfg.n_layers} layers (at most "
                          f"{_max_stages(cfg)})", "$.num_stages")
    if m.layers.stop > cfg.n_layers:
        raise SchemaError(f"{m.layers.stop} is past the model's {cfg.n_layers} layers",
                          "$.layers.stop")
    return m, cfg


def model_manifest(data: Any) -> tuple[ModelManifest, ModelConfig]:
    """A glued model's manifest whose stage ranges cover the model's layers in order, or a
    SchemaError."""
    cfg = _model(data)
    ranges = data.get("stage_ranges")
    # Before structuring walks the list: each range builds a stage.
    if isinstance(ranges, list) and not 1 <= len(ranges) <= _max_stages(cfg):
        raise SchemaError(f"{len(ranges)} ranges for {cfg.n_layers} layers (1 to "
                          f"{_max_stages(cfg)})", "$.stage_ranges")
    m = structure(data, ModelManifest, strict=False)
    at = 0
    for i, r in enumerate(m.stage_ranges):
        if len(r) != 2 or r[0] != at or not r[0] <= r[1] <= cfg.n_layers:
            raise SchemaError(f"expected [{at}, stop] with stop {at}..{cfg.n_layers}, got {r}",
                              f"$.stage_ranges[{i}]")
        at = r[1]
    if at != cfg.n_layers:
        raise SchemaError(f"the ranges end at layer {at}, not at n_layers {cfg.n_layers}",
                          "$.stage_ranges")
    return m, cfg
