"""The field's methods by public name: the number formats a wire codes tensors in, the
compression specs of a stage boundary, and the algorithms that keep a stage group's replicas
one model.

Torch-free: the leader validates specs and plans bytes with these tables on a login node. Each
entry names its torch implementation by ``module:attribute``, imported only where a stage runs
(see ``load``). Adding a method is its one implementation file, one entry here and its tests;
``docs/architecture.md`` walks through it.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import attrs

MAX_BLOCK = 65535  # a frame header's codec_arg (a block size) is a u16


@attrs.frozen
class Element:
    """How numbers cross a wire: a cast (fp16), or codes with one float32 scale per row or per
    block of B consecutive elements of a row (int8, fp8). ``wire_id`` is the frame header's
    codec byte: public, never reused."""

    name: str
    wire_id: int
    bits: int  # per element, scales apart
    scaled: bool  # float32 scales before the codes: one per row, or per ``_bB`` block
    summary: str
    impl: str = ""  # "module:attribute" of an ElementCodec (the built-in casts have none)
    # A boundary's codes too, or the replicas' sync alone (fp4; int4 is on the boundary, in
    # blocks, as the unrotated row beside hadamard_int4).
    boundary: bool = True
    # Only with a block (``_bB``): one scale for a whole row (a ring's lane is one row of up to
    # 4 MiB) leaves 16 integer levels for every gradient in it.
    needs_block: bool = False

    def payload_size(self, shape: tuple[int, ...], block: int = 0) -> int:
        """Bytes of a ``shape`` tensor's payload (``block``: the scale block, 0 a row)."""
        n = 1
        for d in shape:
            n *= d
        if not self.scaled:
            return n * self.bits // 8
        groups = n // (block or shape[-1]) if shape and shape[-1] else 1
        return groups * 4 + (n * self.bits + 7) // 8  # (4-bit codes: two a byte)


ELEMENTS: dict[str, Element] = {e.name: e for e in (
    Element("fp32", 1, 32, False, "float32, exact"),
    Element("fp16", 2, 16, False, "float16 cast"),
    Element("bf16", 3, 16, False, "bfloat16 cast"),
    Element("int8", 4, 8, True, "symmetric absmax int8: codes = round(127 x / max abs x)"),
    Element("fp8", 5, 8, True, "float8 e4m3 (torch.float8_e4m3fn), absmax-scaled to its "
            "largest finite value 448", "swarm_core.pipeline.codec_fp8:Fp8"),
    Element("int4", 6, 4, True, "symmetric absmax 4-bit integers (-7..7), two a byte; in "
            "blocks only (`_bB`)", "swarm_core.pipeline.codec_int4:Int4", needs_block=True),
    Element("fp4", 7, 4, True, "float4 e2m1 (the MX FP4 element: 0, 0.5 ... 6), absmax-scaled "
            "to 6, two a byte; sync only", "swarm_core.pipeline.codec_fp4:Fp4", boundary=False),
)}
SCALED = tuple(e.name for e in ELEMENTS.values() if e.scaled)
# Low-bit codes of a tile after a fixed randomized Hadamard rotation of it (the tile is the
# scale block): the boundary methods ``hadamard_int4[_bB]``, ``hadamard_int2[_bB]``
# (pipeline/codec_hadamard.py), not elements of the fixed, learned or sync grammars. Their
# wire ids are numbered with ELEMENTS', never reused.
ROTATED: dict[str, Element] = {e.name: e for e in (
    Element("hadamard_int4", 8, 4, True, "a tile's randomized Hadamard rotation in symmetric "
            "absmax 4-bit integers (-7..7), two a byte", "swarm_core.pipeline.codec_hadamard:"
            "HadamardInt4", needs_block=True),
    Element("hadamard_int2", 9, 2, True, "a tile's randomized Hadamard rotation in 2 bits, "
            "the levels -1.5, -0.5, 0.5, 1.5 of a step (forward: min(2 absmax/3, 0.996 rms), "
            "clipped; backward: 2 absmax/3), four a byte", "swarm_core.pipeline."
            "codec_hadamard:HadamardInt2", needs_block=True),
)}
BY_WIRE_ID: dict[int, Element] = {e.wire_id: e for e in (*ELEMENTS.values(), *ROTATED.values())}


@attrs.frozen
class BoundaryForm:
    """One grammar of a boundary's compression spec, as the docs table shows it."""

    grammar: str
    summary: str
    # "module:attribute" of its Boundary (pipeline/boundary.py: the modules either side, a
    # codec per side and direction, stateful or not); empty: the default, stateless one.
    impl: str = ""


ON_BOUNDARY = tuple(e.name for e in ELEMENTS.values() if e.scaled and e.boundary)
_BOUNDARY_NAMES = "|".join(ON_BOUNDARY)
_SCALED_NAMES = "|".join(SCALED)
# The rotated codes (ROTATED): a tile is a power of two (the Hadamard transform's size), at
# most MAX_TILE (the transform is a TxT matmul: T multiply-adds an element), DEFAULT_TILE
# unless named.
MIN_TILE, MAX_TILE, DEFAULT_TILE = 4, 1024, 64
_HADAMARD = "swarm_core.pipeline.codec_hadamard:HadamardBoundary"
# K and B are at most six digits: no int() of a thousand-digit string from an API body.
ROTATED_PATTERN = re.compile(rf"({'|'.join(ROTATED)})(?:_b([0-9]{{1,6}}))?")
BOUNDARY_PATTERN = re.compile(
    rf"(?:fixed|learned_dim([0-9]{{1,6}}))(?:_({_BOUNDARY_NAMES})(?:_b([0-9]{{1,6}}))?)?")
BOUNDARY_FORMS: tuple[BoundaryForm, ...] = (
    BoundaryForm("none", "the hidden state crosses in the model's `wire_dtype`"),
    *(f for name in ON_BOUNDARY for f in (
        BoundaryForm(f"fixed_{name}", f"{name} codes, one scale per row of the hidden state; "
                     "straight-through backward, the gradient coded alike"),
        BoundaryForm(f"fixed_{name}_bB", f"{name} codes, one scale per B consecutive elements "
                     "of a row (B from 2, dividing `d_model`): an outlier costs its block"))
      if f.grammar.endswith("_bB") or not ELEMENTS[name].needs_block),
    *(f for name in ROTATED for f in (
        BoundaryForm(name, f"`{name}_bB` with B = 64, or the largest power of two dividing "
                     "`d_model` where that is smaller", _HADAMARD),
        BoundaryForm(f"{name}_bB", f"each tile of B elements of a row (B a power of two, "
                     f"{MIN_TILE}..{MAX_TILE}, dividing `d_model`) rotated by fixed random "
                     "signs and a Walsh-Hadamard transform, then coded "
                     f"{name.removeprefix('hadamard_')} with one scale per tile; stochastic "
                     "rounding on the backward; decoded and rotated back", _HADAMARD))),
    BoundaryForm("learned_bottleneck", "a trained Linear+LayerNorm down to `bottleneck_dim` "
                 "before the boundary and back up after it; the narrow code crosses"),
    BoundaryForm("learned_dimK", "`learned_bottleneck` of width K (1..`d_model`)"),
    *(f for name in ON_BOUNDARY for f in (
        BoundaryForm(f"learned_dimK_{name}", f"the width-K code in {name}, one scale per row"),
        BoundaryForm(f"learned_dimK_{name}_bB", f"the width-K code in {name}, one scale per "
                     "B elements (B dividing K)"))
      if f.grammar.endswith("_bB") or not ELEMENTS[name].needs_block),
)
# Subspace Networks (arXiv 2506.01260): the model keeps its residual stream in
# E(tokens) + U·c, so c's K values per token cross, exactly (pipeline/subspace.py).
SUBSPACE_PATTERN = re.compile(
    rf"subspace_k([0-9]{{1,6}})(?:_({_BOUNDARY_NAMES})(?:_b([0-9]{{1,6}}))?)?")
_SUBSPACE = "swarm_core.pipeline.subspace:SubspaceBoundary"
BOUNDARY_FORMS += (
    BoundaryForm("subspace_kK", "the residual stream confined to E(tokens) + U·c, U a fixed "
                 "dxK orthonormal basis from the seed (1 ≤ K < `d_model`; the residual writers "
                 "kept in span(U)): c's K values per token cross each way, exact; no "
                 "`bottleneck_dim`, no dropout", _SUBSPACE),
    *(f for name in ON_BOUNDARY for f in (
        BoundaryForm(f"subspace_kK_{name}", f"`subspace_kK` with c in {name}, one scale per "
                     "row of K", _SUBSPACE),
        BoundaryForm(f"subspace_kK_{name}_bB", f"`subspace_kK` with c in {name}, one scale "
                     "per B elements (B dividing K)", _SUBSPACE))
      if f.grammar.endswith("_bB") or not ELEMENTS[name].needs_block),
)


def sync_compressions() -> tuple[str, ...]:
    """``sync.compression``'s forms: ``none`` (fp32), a cast, or a scaled code (``_bB``)."""
    return ("none", *(e.name for e in ELEMENTS.values() if not e.scaled and e.name != "fp32"),
            *(f for name in SCALED for f in (
                (f"{name}_bB",) if ELEMENTS[name].needs_block else (name, f"{name}_bB"))))


_SYNC_PATTERN = re.compile(rf"({_SCALED_NAMES})(?:_b([0-9]{{1,6}}))?")


def scaled_sync_form(spec: str) -> tuple[str, str | None] | None:
    """A scaled sync compression's (element, block digits or None), None if ``spec`` is not
    one (a cast, ``none``, or a form its element does not take)."""
    m = _SYNC_PATTERN.fullmatch(spec)
    if m is None or (m.group(2) is None and ELEMENTS[m.group(1)].needs_block):
        return None
    return m.group(1), m.group(2)


@attrs.frozen
class SyncMethod:
    """An algorithm that keeps a stage group's replicas one model (``sync.mode``)."""

    name: str
    # The replicas train apart between syncs (an outer step every ``inner_steps``): they
    # hold one set of weights, and so can checkpoint, only right after one.
    periodic: bool
    impl: str  # "module:attribute" of its GroupSync factory (see pipeline/syncs)
    summary: str
    # Its outer SGD's (lr, momentum) where ``outer_lr``/``outer_momentum`` are left unset
    # (None): the paper's. None: it takes no outer step.
    outer: tuple[float, float] | None = None
    # It codes what it sends itself (``sync.compression`` must be ``none``).
    own_coding: bool = False
    # The optimiser a replica of a group runs: AdamW, or plain SGD (no momentum, matrices
    # decayed) on the direction the algorithm writes into the gradients (DeMo's sign).
    optimizer: str = "adamw"


SYNC_METHODS: dict[str, SyncMethod] = {m.name: m for m in (
    SyncMethod("dp", False, "swarm_core.pipeline.syncs.dp:build",
               "data parallel: every step the gradients' mean over the group, in buckets "
               "that go out while the backward runs (DDP's overlap)"),
    SyncMethod("diloco", True, "swarm_core.pipeline.syncs.diloco:build",
               "DiLoCo (arXiv 2311.08105): `inner_steps` steps alone, then the mean change "
               "through an outer Nesterov SGD; `overlap_steps` overlaps it (Streaming DiLoCo)",
               outer=(0.7, 0.9)),
    SyncMethod("sparseloco", True, "swarm_core.pipeline.syncs.sparseloco:build",
               "SparseLoCo (arXiv 2508.15706): DiLoCo's change added to an error feedback "
               "(`error_decay`), its top `density` per tile of `chunk` elements sent in "
               "`value_bits` bits and all-gathered; the mean applied by an outer SGD, no "
               "momentum", outer=(1.0, 0.0), own_coding=True),
    SyncMethod("demo", False, "swarm_core.pipeline.syncs.demo:build",
               "DeMo (arXiv 2411.19870): every step each replica's own momentum "
               "(`momentum_decay`), its `topk` largest DCT components per `dct_chunk` block "
               "sent (signs only with `sign_values`) and taken out of it; SGD on the sign of "
               "the group's mean", own_coding=True, optimizer="sgd"),
)}


def load(impl: str) -> Any:
    """The implementation an entry names (``module:attribute``), imported now."""
    module, _, attr = impl.partition(":")
    return getattr(importlib.import_module(module), attr)
