"""Model and training profiles. Field names and compression spec strings are public interface."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any, Literal, get_args

import attrs

from swarm_core.config import methods
from swarm_core.config.methods import (
    BOUNDARY_PATTERN,
    MAX_BLOCK,
    SUBSPACE_PATTERN,
    SYNC_METHODS,
    scaled_sync_form,
    sync_compressions,
)
from swarm_core.config.network import LinkMatrix
from swarm_core.config.selective import CompressWhen, selective_error
from swarm_core.protocol import LinkLimits
from swarm_core.schema import FieldError, checking
from swarm_core.validators import MAX_STEPS, bounded, meta

WireDtype = Literal["fp32", "fp16", "bf16"]
Schedule = Literal["gpipe", "1f1b", "eager"]
SyncMode = Literal["dp", "diloco", "sparseloco", "demo"]
SYNC_MODES: tuple[str, ...] = get_args(SyncMode)



@attrs.frozen
class Compression:
    """A parsed compression spec: what crosses each stage boundary."""

    spec: str
    bottleneck_dim: int | None  # None: the full hidden width crosses
    # The scaled code (``int8``, ``fp8``) forward and backward, straight-through; None: the
    # model's wire_dtype.
    element: str | None = None
    # Its scales: 0 = one per row (the boundary's width); B = one per B consecutive elements
    # of a row, so one outlier spoils B codes, not a row, for 4/B bytes per element.
    block: int = 0
    form: str = "none"  # the grammar it matched (methods.BOUNDARY_FORMS), e.g. fixed_int8_bB
    # ``subspace_kK``: the K coordinates of the residual stream in the model's fixed basis
    # cross (pipeline/subspace.py); None: another method.
    subspace: int | None = None

    @property
    def every_stage_reads_tokens(self) -> bool:
        """Every stage needs the step's token ids, not only the first and the last: a
        subspace boundary rebuilds the fixed embedding E(tokens) on each side."""
        return self.subspace is not None

    @property
    def learned(self) -> bool:
        return self.bottleneck_dim is not None

    @property
    def int8(self) -> bool:
        return self.element == "int8"

    @property
    def int8_block(self) -> int:
        return self.block if self.int8 else 0


def parse_compression(spec: str, bottleneck_dim: int | None = None,
                      d_model: int | None = None) -> Compression:
    """A spec by the grammars of ``methods.BOUNDARY_FORMS``: ``none``, ``fixed_E`` (E a
    scaled code: int8, fp8; ``_bB``: one scale per B elements), ``learned_bottleneck``
    (+bottleneck_dim), ``learned_dimK``, ``learned_dimK_E`` (``_bB`` likewise). Anything
    else is an error naming the valid forms."""
    if spec == "learned_bottleneck":
        if bottleneck_dim is None:
            raise FieldError("learned_bottleneck needs bottleneck_dim", "bottleneck_dim")
        return _checked(spec, spec, bottleneck_dim, None, None, d_model)
    if spec.startswith("subspace_"):
        return _subspace(spec, bottleneck_dim, d_model)
    rotated = methods.ROTATED_PATTERN.fullmatch(spec)
    if rotated is not None:
        return _rotated(spec, rotated.group(1), rotated.group(2), d_model)
    forms = [f.grammar for f in methods.BOUNDARY_FORMS]
    m = BOUNDARY_PATTERN.fullmatch(spec)
    if m is None or (spec.startswith("fixed") and m.group(2) is None):
        if spec in forms and not re.search(r"dimK|_bB", spec):  # (a plain name: none, …)
            return Compression(spec, None, form=spec)
        raise FieldError(
            f"unknown compression {spec!r}; valid forms: {', '.join(forms)} "
            "(K and B positive integers, B dividing the boundary's width)", "compression")
    dim = int(m.group(1)) if m.group(1) is not None else None
    form = ("fixed" if dim is None else "learned_dimK") \
        + (f"_{m.group(2)}" if m.group(2) else "") + ("_bB" if m.group(3) else "")
    return _checked(spec, form, dim, m.group(2), m.group(3), d_model)


def _rotated(spec: str, name: str, block: str | None, d_model: int | None) -> Compression:
    """``hadamard_int4[_bB]``, ``hadamard_int2[_bB]``: the tile B is both the rotation's size
    and the scale block; unnamed, 64, or the largest power of two dividing ``d_model`` where
    that is smaller."""
    lo, hi = methods.MIN_TILE, methods.MAX_TILE
    if block is None:
        tile = methods.DEFAULT_TILE if d_model is None else min(methods.DEFAULT_TILE,
                                                                d_model & -d_model)
        if tile < lo:
            raise FieldError(f"{spec!r} tiles d_model ({d_model}) by powers of two from {lo}, "
                             f"and {d_model} has none", "compression")
        return Compression(spec, None, name, tile, name)
    b = int(block)
    if not lo <= b <= hi or b & (b - 1) or (d_model is not None and d_model % b):
        raise FieldError(f"{name} tile {b} in {spec!r} must be a power of two, {lo}..{hi}, "
                         f"dividing d_model ({d_model})", "compression")
    return Compression(spec, None, name, b, f"{name}_bB")


def _subspace(spec: str, bottleneck_dim: int | None, d_model: int | None) -> Compression:
    """``subspace_kK[_E[_bB]]``: K from 1 to below ``d_model`` (at d_model nothing is
    saved), no learned bottleneck beside it (the stream crosses as its coordinates, or not at
    all), a block dividing K."""
    m = SUBSPACE_PATTERN.fullmatch(spec)
    if m is None:
        forms = [f.grammar for f in methods.BOUNDARY_FORMS]
        raise FieldError(f"unknown compression {spec!r}; valid forms: {', '.join(forms)} "
                         "(K and B positive integers, B dividing the boundary's width)",
                         "compression")
    k = int(m.group(1))
    if k < 1 or (d_model is not None and k >= d_model):
        raise FieldError(f"subspace width {k} in {spec!r} must be 1..d_model-1 "
                         f"({d_model}): at d_model nothing is saved", "compression")
    if bottleneck_dim is not None:
        raise FieldError(f"{spec!r} takes no bottleneck_dim ({bottleneck_dim}): a subspace "
                         "boundary sends the stream's own coordinates, not a learned code",
                         "compression")
    form = "subspace_kK" + (f"_{m.group(2)}" if m.group(2) else "") \
        + ("_bB" if m.group(3) else "")
    c = _checked(spec, form, k, m.group(2), m.group(3), d_model)
    return attrs.evolve(c, bottleneck_dim=None, subspace=k)


def _checked(spec: str, form: str, dim: int | None, element: str | None, block: str | None,
             d_model: int | None) -> Compression:
    if dim is not None and (dim < 1 or (d_model is not None and dim > d_model)):
        raise FieldError(f"bottleneck width {dim} must be 1..d_model ({d_model})", "compression")
    b = int(block) if block is not None else 0
    width = dim if dim is not None else d_model
    if block is None and element is not None and methods.ELEMENTS[element].needs_block:
        raise FieldError(f"{element} takes a scale block in {spec!r}: {spec}_bB, B from 2 "
                         f"dividing the boundary's width ({width})", "compression")
    if block is not None and (not 2 <= b <= MAX_BLOCK or (width is not None and width % b)):
        raise FieldError(f"{element} block {b} in {spec!r} must be 2..{MAX_BLOCK} and divide "
                         f"the boundary's width ({width})", "compression")
    return Compression(spec, dim, element, b, form)


def _pos(_i: Any, a: attrs.Attribute, v: int | float) -> None:
    if not v > 0:
        raise FieldError(f"must be > 0, got {v}", a.name)


def _nonneg(_i: Any, a: attrs.Attribute, v: int | float) -> None:
    if v < 0:
        raise FieldError(f"must be >= 0, got {v}", a.name)


def _le(hi: float):
    def check(_i: Any, a: attrs.Attribute, v: int | float) -> None:
        if v > hi:
            raise FieldError(f"must be <= {hi:g}, got {v}", a.name)

    return check


SYNC_CODECS = sync_compressions()


def _optional(*checks: Any) -> Any:
    def check(i: Any, a: attrs.Attribute, v: Any) -> None:
        if v is not None:
            for c in checks:
                c(i, a, v)

    return check


MAX_FRAGMENTS = 64
VALUE_BITS = (1, 2, 4, 8, 32)  # SparseLoCo's values: codes of a 2^b-entry lookup, or float32


def _bits(_i: Any, a: attrs.Attribute, v: int) -> None:
    if v not in VALUE_BITS:
        raise FieldError(f"must be one of {', '.join(map(str, VALUE_BITS))}, got {v}", a.name)


@attrs.frozen
class SyncConfig:
    """How the replicas of a stage keep one set of weights (a job of one replica has none to
    keep): ``dp`` all-reduces their gradients every step; ``diloco`` lets each replica take
    ``inner_steps`` optimiser steps alone, then averages the change and applies it with an
    outer SGD (Nesterov momentum; the DiLoCo paper's lr 0.7 and momentum 0.9). Both run
    around a ring over the same shaped links as the pipeline. ``compression`` codes what
    crosses, as a boundary's codec does (int8 sums in fp32 after decoding, as INTELLECT-1's
    ring does). ``overlap_steps`` (a periodic mode): the outer step's average crosses while
    each replica trains this many more inner steps, which it keeps (Streaming DiLoCo's
    overlap; 0: the replicas wait for it, as in the paper).

    ``sparseloco`` keeps DiLoCo's cadence but sends each replica's change sparse: added to
    its error feedback (decayed by ``error_decay``), the top ``density`` of each tile of
    ``chunk`` elements by magnitude, in ``value_bits`` bits, all-gathered; what was not sent
    stays in the feedback. ``outer_lr``/``outer_momentum`` left out (None) are the mode's
    paper's: DiLoCo 0.7 and 0.9, SparseLoCo 1 and none (its error feedback stands for it; a
    momentum set is DiLoCo's Nesterov, as MuLoCo's 2-bit runs have it)."""

    mode: SyncMode = "dp"
    compression: str = "none"
    inner_steps: int = attrs.field(default=500, validator=[_pos, _le(1_000_000)])
    outer_lr: float | None = attrs.field(default=None, validator=_optional(_pos, _le(10.0)))
    outer_momentum: float | None = attrs.field(default=None,
                                               validator=_optional(_nonneg, _le(0.999)))
    # dp's gradients go in buckets of this many MiB (DDP's bucket_cap_mb and default; the
    # first at most 1 MiB), each all-reduced as soon as the backward has finished it.
    bucket_mb: float = attrs.field(default=25.0, validator=[_pos, _le(1024.0)])
    overlap_steps: int = attrs.field(default=0, validator=[_nonneg, _le(1_000_000)])
    # Streaming DiLoCo (arXiv 2501.18512): a periodic mode's parameters in this many
    # fragments taking turns: fragment f synced every inner_steps steps, about inner_steps/P
    # after fragment f-1 (see ``turns``).
    fragments: int = attrs.field(default=1, validator=[_pos, _le(MAX_FRAGMENTS)])
    # Which parameters make a fragment: ``strided`` (the paper's: block b in fragment b mod
    # P) or ``sequential`` (contiguous runs of about equal size); sequential wherever a
    # stage holds fewer blocks than fragments.
    fragment_pattern: Literal["strided", "sequential"] = "strided"
    # SparseLoCo (arXiv 2508.15706; the defaults are the issue's, the paper's runs use 3 %):
    density: float = attrs.field(default=0.02, validator=[_pos, _le(1.0)])
    chunk: int = attrs.field(default=4096, validator=[_pos, _le(1 << 20)])
    value_bits: int = attrs.field(default=2, validator=_bits)
    error_decay: float = attrs.field(default=0.95, validator=[_nonneg, _le(1.0)])
    # DeMo (arXiv 2411.19870; the defaults are Psyche's runs': 64, 8, 1-bit, 0.999):
    dct_chunk: int = attrs.field(default=64, validator=[_pos, _le(4096)])
    topk: int = attrs.field(default=8, validator=[_pos, _le(1 << 24)])
    sign_values: bool = True
    momentum_decay: float = attrs.field(default=0.999, validator=[_nonneg, _le(0.9999)])

    def __attrs_post_init__(self) -> None:
        if not checking():
            return
        if self.fragments > 1 and not self.periodic:
            raise FieldError(f"must be 1 under {self.mode}, which syncs every step: fragments "
                             f"take turns between a periodic mode's syncs, got {self.fragments}",
                             "fragments")
        if self.periodic and self.fragments > self.inner_steps:
            raise FieldError(f"must be at most inner_steps ({self.inner_steps}): fragments "
                             f"take turns, one after a step, got {self.fragments}", "fragments")
        gap = self.inner_steps // self.fragments  # (the shortest from one turn to the next)
        if self.periodic and self.overlap_steps >= gap:
            whose = "inner_steps" if self.fragments == 1 else "inner_steps // fragments"
            raise FieldError(f"must be below {whose} ({gap}): the outer step's average has to "
                             f"land before the next one, got {self.overlap_steps}",
                             "overlap_steps")
        method = SYNC_METHODS[self.mode]
        if method.own_coding and self.compression != "none":
            raise FieldError(f"must be none under {self.mode}, which codes what it sends "
                             f"itself, got {self.compression!r}", "compression")
        m = scaled_sync_form(self.compression)
        if self.compression not in SYNC_CODECS and m is None:
            raise FieldError(f"unknown sync compression {self.compression!r}; valid forms: "
                             f"{', '.join(SYNC_CODECS)} (B from 2)", "compression")
        if m is not None and m[1] is not None and not 2 <= int(m[1]) <= MAX_BLOCK:
            raise FieldError(f"{m[0]} block {m[1]} must be 2..{MAX_BLOCK}", "compression")

    @property
    def outer_step(self) -> tuple[float, float]:
        """The outer SGD's (lr, momentum): the fields, or where unset the mode's paper's."""
        lr, momentum = SYNC_METHODS[self.mode].outer or (1.0, 0.0)
        return (lr if self.outer_lr is None else self.outer_lr,
                momentum if self.outer_momentum is None else self.outer_momentum)

    # The cadence: one rule for the stage, the leader's membership and the checkpoints.
    @property
    def periodic(self) -> bool:
        """The replicas train apart between syncs (DiLoCo's outer steps), so they hold one
        set of weights only right after one."""
        return SYNC_METHODS[self.mode].periodic

    @property
    def period(self) -> int:
        """The most steps from one sync to the next: ``inner_steps`` for a periodic method
        (over ``fragments``: from one fragment's turn to the next one's, rounded up), else 1."""
        return -(-self.inner_steps // self.fragments) if self.periodic else 1

    @property
    def turns(self) -> tuple[int, ...]:
        """Each fragment's turn: fragment f syncs after the 1-based steps n with n mod H =
        floor((f+1) H / P) mod H (torchft's offsets; every H/P steps where P divides H), the
        last fragment every H steps, as without fragments."""
        h, p = self.inner_steps, self.fragments
        return tuple((f + 1) * h // p % h for f in range(p))

    def fragment_after(self, step: int) -> int:
        """The fragment whose turn it is after 1-based step ``step`` (a step ``syncs_after``
        names, the run's last aside)."""
        return self.turns.index(step % self.inner_steps)

    @property
    def lag(self) -> int:
        """Steps from a sync's start until its result lands (an overlapped outer step's)."""
        return self.overlap_steps if self.periodic else 0

    def syncs_after(self, step: int, steps: int) -> bool:
        """Whether the group syncs after 1-based step ``step`` of a ``steps``-step run: every
        step (dp), every ``inner_steps`` (a fragment's turn, with ``fragments``), and after
        the last so the run ends on one set of weights."""
        if not self.periodic:
            return True
        return step % self.inner_steps in self.turns or step == steps

    def next_sync(self, step: int) -> int:
        """The 0-based step of the first sync after 0-based step ``step`` (the run's last
        step aside)."""
        after = step + 1
        while not self.syncs_after(after + 1, 0):
            after += 1
        return after

    def last_sync_before(self, step: int) -> int:
        """The 1-based step of the last sync before 1-based step ``step`` (0: the start)."""
        before = step - 1
        while before > 0 and not self.syncs_after(before, 0):
            before -= 1
        return max(before, 0)

    def drifts(self, replicas: int) -> bool:
        """Whether ``replicas`` replicas hold different weights between syncs."""
        return replicas > 1 and self.periodic

    @property
    def label(self) -> str:
        """As tables show it: ``dp``, ``dp int8``, ``diloco H=10``, ``diloco H=10 overlap 5``
        (a mode's own fields only: dp has no period)."""
        label = f"{self.mode} H={self.inner_steps}" if self.periodic else self.mode
        if self.mode == "sparseloco":  # (each mode's own fields: the label is a table's)
            label += f" d={self.density:g} {self.value_bits}-bit"
        elif self.mode == "demo":
            label += f" top{self.topk}/{self.dct_chunk}" + (" 1-bit" if self.sign_values else "")
        if self.compression != "none":
            label += f" {self.compression}"
        if self.periodic and self.overlap_steps:
            label += f" overlap {self.overlap_steps}"
        if self.fragments > 1:
            label += f" {self.fragments} fragments" + (
                "" if self.fragment_pattern == "strided" else f" {self.fragment_pattern}")
        return label

    @property
    def codec(self) -> tuple[str, int]:
        """The wire codec's name (fp32 for none) and its scale block (0: one per row)."""
        m = scaled_sync_form(self.compression)
        if m is not None:
            return m[0], int(m[1] or 0)
        return ("fp32" if self.compression == "none" else self.compression), 0


@attrs.frozen  # (so its parsed compression spec is worked out once)
class ModelConfig:
    """A GPT-style decoder and what crosses its stage boundaries."""

    name: str = "model"
    d_model: int = attrs.field(default=128, validator=[_pos, _le(16384)])
    n_layers: int = attrs.field(default=4, validator=[_pos, _le(1024)])
    n_heads: int = attrs.field(default=4, validator=[_pos, _le(256)])
    seq_len: int = attrs.field(default=64, validator=[_pos, _le(65536)])
    vocab_size: int | None = attrs.field(default=None)  # None: the tokenizer's
    dropout: float = attrs.field(default=0.0, validator=[_nonneg, _le(0.9)])
    dtype: Literal["float32", "bfloat16"] = "float32"
    compression: str = "none"
    bottleneck_dim: int | None = None
    wire_dtype: WireDtype = "fp32"  # codec for uncompressed boundaries
    tie_weights: bool = False
    mlp_ratio: int = attrs.field(default=4, validator=[_pos, _le(16)])
    # "gpt2": every Linear N(0, 0.02) with zero biases, the residual projections scaled by
    # 1/sqrt(2 n_layers) (the field's baseline); "torch": PyTorch's defaults, what runs before
    # this field trained with (a manifest without the field was trained so).
    init: Literal["gpt2", "torch"] = "gpt2"

    def __attrs_post_init__(self) -> None:
        if not checking():
            return
        if self.d_model % self.n_heads:
            raise FieldError(f"d_model {self.d_model} is not divisible by n_heads "
                             f"{self.n_heads}", "n_heads")
        if self.vocab_size is not None and not 2 <= self.vocab_size <= 1 << 20:
            raise FieldError("must be 2..1048576 or null", "vocab_size")
        _ = self.compression_spec  # a spec that does not parse is refused here
        if self.dropout and self.compression_spec.subspace is not None:
            # (a dropped-out write leaves span(U): the stream would no longer cross exactly)
            raise FieldError(f"must be 0 under {self.compression!r}, whose residual stream "
                             f"stays in a fixed subspace, got {self.dropout:g}", "dropout")

    @functools.cached_property
    def compression_spec(self) -> Compression:
        return parse_compression(self.compression, self.bottleneck_dim, self.d_model)


# A job id as the leader issues them (``job-000012``; the sequence outgrows six digits).
JOB_ID = re.compile(r"job-[0-9]{6,19}")


def _job_id(_i: Any, a: attrs.Attribute, v: str) -> None:
    if not JOB_ID.fullmatch(v):
        raise FieldError(f"must be a job id such as job-000012, got {v[:40]!r}", a.name)


_job_id.json_schema = {"pattern": f"^{JOB_ID.pattern}$"}  # type: ignore[attr-defined]


@attrs.frozen
class WarmStart:
    """Start a job from another job's checkpoint weights instead of the seeded init: only the
    weights are taken (the optimiser state, the outer state and the lr schedule start fresh,
    at step 0), and the stage split may differ from the source's. The model must equal the
    source's in every field but ``name``."""

    job_id: str = attrs.field(validator=_job_id, metadata=meta(
        "the job whose checkpoint the weights come from, on this leader"))
    step: int | None = attrs.field(default=None, validator=bounded(1, MAX_STEPS), metadata=meta(
        "its checkpoint's step; null: its newest complete checkpoint, which the leader "
        "resolves at submit (the job's spec then names it)", minimum=1, maximum=MAX_STEPS))


# torch threads per stage: more than any machine here gives one process.
MAX_THREADS = 256


@attrs.define
class TrainingConfig:
    """Data, schedule and optimiser of a training job."""

    name: str = "training"
    dataset: Literal["shakespeare", "textfiles", "wikitext103"] = "shakespeare"
    dataset_paths: list[str] = attrs.field(factory=list)
    tokenizer: Literal["byte", "bpe"] = "byte"
    bpe_vocab_size: int = attrs.field(default=4096, validator=[_pos, _le(1 << 17)])
    real_min_tokens: int = attrs.field(default=0, validator=_nonneg)
    validation_fraction: float = attrs.field(default=0.05, validator=[_pos, _le(0.5)])
    seed: int = attrs.field(default=0, validator=_nonneg)
    steps: int = attrs.field(default=20, validator=[_pos, _le(10_000_000)])
    batch_size: int = attrs.field(default=8, validator=[_pos, _le(1 << 16)])
    micro_batches: int = attrs.field(default=4, validator=[_pos, _le(4096)])
    schedule: Schedule = "1f1b"
    # Send input gradients upstream before computing weight gradients, which then run while the
    # stage would wait (zero-bubble style); same losses, less idle time.
    split_backward: bool = True
    lr: float = attrs.field(default=3e-3, validator=[_pos, _le(10.0)])
    min_lr: float = attrs.field(default=3e-4, validator=[_nonneg, _le(10.0)])
    warmup_steps: int = attrs.field(default=5, validator=_nonneg)
    weight_decay: float = attrs.field(default=0.01, validator=[_nonneg, _le(10.0)])
    betas: list[float] = attrs.field(factory=lambda: [0.9, 0.95])
    # ``muon``: Muon (torch.optim.Muon, Nesterov momentum 0.95, its lr matched to AdamW's RMS)
    # on the hidden matrices, AdamW on the embeddings, the head and the vectors (the Muon and
    # MuLoCo papers' split); under a periodic sync it is the inner optimiser.
    optimizer: Literal["adamw", "muon"] = "adamw"
    grad_clip: float = attrs.field(default=1.0, validator=_nonneg)  # 0: off
    eval_every: int = attrs.field(default=0, validator=_nonneg)  # 0: only at the end
    eval_batches: int = attrs.field(default=2, validator=[_nonneg, _le(1000)])
    stage_weights: list[float] | None = None
    frame_timeout_s: float = attrs.field(default=60.0, validator=[_pos, _le(86400.0)])
    threads: int = attrs.field(default=1, validator=[_pos, _le(MAX_THREADS)])
    max_final_loss: float | None = None
    export_dir: str | None = None
    # Steps between checkpoints pushed to the leader (0: only the last). Under DiLoCo each
    # falls right after the next outer step, where every replica's state can be restored.
    shard_push_interval_steps: int = attrs.field(default=0, validator=_nonneg)
    # Link limits every fellow of the job applies for its duration (a sweep's network profile).
    link: LinkLimits | None = None
    # Per-pair links (a network profile's matrix): each peer link shaped by its site pair,
    # under the fellow's ``link`` above.
    network: LinkMatrix | None = None
    # Selective compression (issue 34 point 4): the boundary's and the sync's compression only
    # on the links this names (under a rate, or of named replicas); None: on every link.
    compress_when: CompressWhen | None = None
    # When a fellow dies mid-run: fail the job, or resume from the latest pushed shards on a
    # replacement (the fellows that are still alive keep their stages).
    resume_policy: Literal["fail", "replace"] = "fail"
    max_restarts: int = attrs.field(default=3, validator=[_nonneg, _le(1000)])
    # How the replicas of each stage stay one model (topology.replicas above 1).
    sync: SyncConfig = attrs.field(factory=SyncConfig)
    # The data plane: ``shaped``, the app's own TCP links (their token buckets see every byte:
    # link limits, per-pair links and set-speed apply); ``torch``, the same frames over
    # torch.distributed gloo groups, one per link (unshaped: the buckets cannot see gloo's
    # sockets), and the stage groups' fp32 data-parallel mean as gloo's all_reduce.
    transport: Literal["shaped", "torch"] = "shaped"
    # The weights of another job's checkpoint in place of the seeded init (issue 38: the sync
    # figure's runs from one warm start); a resumed run takes its own checkpoint instead.
    warm_start: WarmStart | None = None

    def checkpoint_after(self, step: int, outer_steps: bool = False) -> bool:
        """Whether a checkpoint is taken after 1-based step ``step``, short of the last:
        every ``shard_push_interval_steps``. With ``outer_steps`` (replicas under DiLoCo)
        only where the replicas hold one set of weights, after an outer step: the first such
        step at or past each multiple of the interval, so a resume takes up every replica's
        state exactly."""
        every = self.shard_push_interval_steps
        if not every or step >= self.steps:
            return False
        if outer_steps:
            return self.sync.syncs_after(step, self.steps) \
                and step // every != self.sync.last_sync_before(step) // every
        return step % every == 0

    def follows_a_pause(self, step: int, start_step: int = 0,
                        outer_steps: bool = False) -> bool:
        """Whether 1-based ``step`` comes right after time out of training: the first step of
        a run (or of a resume from ``start_step``), which waits for the neighbours to start,
        or the one after an evaluation or a shard push (``outer_steps``: as
        :meth:`checkpoint_after`), which waits for them to finish it. Link waits measured in
        such a step are not the network's."""
        done = step - 1
        return done == start_step or bool(self.eval_every and done % self.eval_every == 0) \
            or self.checkpoint_after(done, outer_steps)

    def __attrs_post_init__(self) -> None:
        if not checking():
            return
        if self.batch_size % self.micro_batches:
            raise FieldError(f"batch_size {self.batch_size} is not divisible by micro_batches "
                             f"{self.micro_batches}", "micro_batches")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise FieldError("must be two numbers in [0, 1)", "betas")
        if self.optimizer != "adamw" and SYNC_METHODS[self.sync.mode].optimizer != "adamw":
            raise FieldError(f"must be adamw under sync.mode {self.sync.mode}, whose replicas "
                             f"step plain SGD on its own direction, got {self.optimizer!r}",
                             "optimizer")
        if self.dataset == "textfiles" and not self.dataset_paths:
            raise FieldError("dataset 'textfiles' needs dataset_paths", "dataset_paths")
        shaped_by_app = self.network is not None or (self.link is not None and (
            self.link.tx_mbps or self.link.rx_mbps or self.link.latency_ms))
        if self.transport == "torch" and shaped_by_app:
            raise FieldError("must be 'shaped' where the job's link or network shapes its links "
                             "(the app's token buckets cannot see gloo's sockets: use a tc "
                             "profile for a torch job), got 'torch'", "transport")
        if self.stage_weights is not None and any(w < 0 for w in self.stage_weights):
            raise FieldError("weights must be >= 0", "stage_weights")
        if self.export_dir is not None:
            parts = PurePosixPath(self.export_dir.replace("\\", "/")).parts
            if not parts or self.export_dir.startswith(("/", "~")) or ".." in parts \
                    or ":" in self.export_dir:
                raise FieldError("must be a relative path inside the fellow's runs directory "
                                 "(no '..', no absolute path)", "export_dir")


def job_shape_error(model: ModelConfig, training: TrainingConfig, stages: int,
                    replicas: int = 1, layout: Sequence[Sequence[int]] | None = None
                    ) -> tuple[str, str] | None:
    """Why this model, training config and stage count cannot run together, with the field at
    fault (``training.stage_weights``, ``training.min_lr``, ``topology``,
    ``model.bottleneck_dim`` or ``model.vocab_size``); None if they can. (Checked where configs
    come in, not in the schemas: stored configs from before a rule still load.)
    The leader refuses such a job and ``swarm validate`` such a config, by this one rule.
    ``layout``: a swarm job's cell ids per stage (``topology.layout``), where it has one."""
    if replicas > 1 and training.batch_size % (replicas * training.micro_batches):
        # (each replica takes its own share of the step's windows, in micro_batches)
        return (f"batch_size {training.batch_size} is not divisible by {replicas} replicas x "
                f"{training.micro_batches} micro_batches", "training.batch_size")
    if training.stage_weights is not None and len(training.stage_weights) != stages:
        return (f"{len(training.stage_weights)} weights for {stages} stages",
                "training.stage_weights")
    if training.network is not None:
        # (a layout's extra cells need their sites too: every id up to its largest)
        width = replicas if not layout else max(replicas, 1 + max(map(max, layout)))
        placed = training.network.shape_error(stages, replicas, width)
        if placed is not None:
            return placed, "training.network"
    selective = selective_error(model, training, stages, replicas)
    if selective is not None:
        return selective, "training.compress_when"
    if stages > model.n_layers + 2:
        return (f"{stages} stages for {model.n_layers} layers leaves stages with nothing to do",
                "topology")
    comp = model.compression_spec
    if (model.bottleneck_dim is not None and comp.learned
            and model.compression != "learned_bottleneck"
            and model.bottleneck_dim != comp.bottleneck_dim):
        # (Before this rule the spec's K won.)
        return (f"bottleneck_dim {model.bottleneck_dim} contradicts {model.compression!r}, "
                f"which names width {comp.bottleneck_dim} (leave bottleneck_dim out)",
                "model.bottleneck_dim")
    if training.min_lr > training.lr:  # (the rate would rise all run: a low lr set alone)
        return (f"min_lr {training.min_lr:g} is above lr {training.lr:g}; the schedule decays "
                "from lr to min_lr", "training.min_lr")
    if training.tokenizer == "byte" and model.vocab_size is not None and model.vocab_size < 256:
        return (f"vocab_size {model.vocab_size} is smaller than the byte tokenizer's 256 "
                "tokens", "model.vocab_size")
    return None


def warm_start_mismatch(model: ModelConfig, training: TrainingConfig,
                        source_model: ModelConfig, source_training: TrainingConfig) -> str | None:
    """Why a job of ``model`` cannot start from the weights of a job of ``source_model``, or
    None where it can. The rule is the whole ModelConfig but its name: stricter than the
    parameters' shapes (dropout or wire_dtype shape none), but one a reader can check at a
    glance, and a weight trained under another boundary codec or dtype is another model's.
    The tokenizer must be the source's too, so a token id means the same token: the same
    kind, and a BPE one trained alike (its vocabulary size, on the same dataset's text)."""
    mine = attrs.asdict(model, recurse=False)
    theirs = attrs.asdict(source_model, recurse=False)
    differ = [f"{k} {theirs[k]!r} vs {mine[k]!r}" for k in mine
              if k != "name" and mine[k] != theirs[k]]
    if not differ and _tokens(training) != _tokens(source_training):
        differ.append(f"the tokenizer ({_tokens(source_training)} vs {_tokens(training)})")
    if not differ:
        return None
    return "model differs in " + ", ".join(differ)


def _tokens(t: TrainingConfig) -> tuple[Any, ...]:
    """What a token id means: the tokenizer, and a BPE one's size and the text it learnt."""
    if t.tokenizer != "bpe":
        return (t.tokenizer,)
    return (t.tokenizer, t.bpe_vocab_size, t.dataset, tuple(t.dataset_paths))
