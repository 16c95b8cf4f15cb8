"""A run's ``metrics_summary.json`` as a class: the runner writes it from :class:`MetricsSummary`,
and the report, a sweep's and a suite's closing tables read it back into one
(:func:`parse_summary`), through the project's structuring.

A summary is input to its readers (half-written, hand-edited, from an older version): every
field may be null or absent (a run from before the field shows "-"), keys a reader does not know
are ignored (a newer version's), and damage is one line naming the field, its value and what it
should be (``final_loss is "low", not a number``).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import attrs

from swarm_core import jsonio
from swarm_core.config.grid import SyncAxis
from swarm_core.contract import CodecErrors, LinkChange, MembershipChange, Restart
from swarm_core.schema import FieldError, SchemaError, structure, unstructure

SYNC_MODES: tuple[str, ...] = typing.get_args(SyncAxis)  # ("none", then every sync mode)


def _above_zero(_inst: Any, attr: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise FieldError(f"must be above 0, got {value}", attr.name)


def _expecting(what: str) -> dict[str, str]:
    """A field's metadata: what its value should be, said in a damage line, where its type
    does not say it plainly."""
    return {"expects": what}


@attrs.define
class Threshold:
    """A limit the run's training profile set on a figure, and whether the run kept it."""

    limit: float
    value: float | None
    met: bool


@attrs.define
class MetricsSummary:
    """What a run came to: its outcome, figures, setting, grid, per-stage figures and the
    changes it went through. Field order is the file's key order."""

    run_id: str | None = None
    job_id: str | None = None
    status: str | None = None
    reason: str | None = None
    steps_expected: int | None = None
    steps_recorded: int | None = None
    final_loss: float | None = None
    best_loss: float | None = None
    eval_loss: float | None = None
    perplexity: float | None = None
    wall_time_s: float | None = None
    tokens_per_s: float | None = None
    wire_bytes_per_step: float | None = None
    expected_wire_bytes_per_step: float | None = None
    uncompressed_wire_bytes_per_step: float | None = None
    compression_ratio: float | None = None
    # What the compression figure places the run by: its spec, network, links' rate (null:
    # unshaped) and latency, and the model and seed it pools over.
    compression: str | None = None
    network_profile: str | None = None
    link_mbps: float | None = attrs.field(
        default=None, validator=_above_zero, metadata=_expecting("a number above 0"))
    latency_ms: float | None = None
    model: str | None = None
    seed: int | None = None
    repeat: int | None = None
    fellows: int | None = None
    # The grid and its synchronisation (``none`` for one replica, else a sync mode, every one
    # registered; a periodic mode's cadence)
    stages: int | None = None
    replicas: int | None = None
    sync_mode: SyncAxis | None = attrs.field(
        default=None, metadata=_expecting(f"one of {', '.join(SYNC_MODES)}"))
    inner_steps: int | None = None
    overlap_steps: int | None = None
    sync_compression: str | None = None
    sync_bytes_per_step: float | None = None
    sync_bytes_total: float | None = None
    total_bytes: float | None = None
    # By stage index (null for a stage that never reported)
    activation_peak_bytes_by_stage: list[int | None] | None = attrs.field(
        default=None, metadata=_expecting("a list of integers by stage"))
    wait_fraction_by_stage: list[float | None] | None = attrs.field(
        default=None, metadata=_expecting("a list of numbers by stage"))
    codec_error_by_stage: list[CodecErrors | None] | None = attrs.field(
        default=None, metadata=_expecting("a list of {act, grad} numbers by stage"))
    # Set-speeds while it ran: its network was not the profile's throughout.
    link_changes: list[LinkChange] | None = attrs.field(
        default=None, metadata=_expecting("a list of objects with an integer at_step"))
    link_changes_total: int | None = None
    # Recoveries (a fellow lost, its stage handed on), and who left a job of replicas or
    # joined it, and from which step.
    restarts: list[Restart] | None = attrs.field(
        default=None, metadata=_expecting("a list of restarts"))
    membership: list[MembershipChange] | None = attrs.field(
        default=None, metadata=_expecting("a list of membership changes"))
    thresholds: dict[str, Threshold] | None = attrs.field(
        default=None, metadata=_expecting("an object of {limit, value, met} by figure"))
    # None when the run set no threshold; a run that did not complete met none of its own.
    thresholds_met: bool | None = None
    # (Added after the keys above, which keep their order.) The boundary as planned at the
    # run's shapes (wire_math.step_boundary_bytes): the ACT frames forward and the GRAD frames
    # backward all stages send per step, headers included (the clip's NORM frames and the
    # replicas' sync apart); and fp32 ``none``'s planned boundary bytes over this spec's, both
    # directions counted (null: no boundary).
    act_bytes_per_step: float | None = None
    grad_bytes_per_step: float | None = None
    boundary_ratio: float | None = None
    # Emulated slow peers (swarm_core.pipeline.pace): the largest compute slowdown each cell
    # was padded to, by its label; null where no cell was slowed. Emulation, not hardware.
    emulated_slowdown_by_cell: dict[str, float] | None = attrs.field(
        default=None, metadata=_expecting("an object of numbers by cell"))
    # The data plane (training.transport): ``torch`` moved its bytes over gloo, where the
    # app's token buckets do not reach (``link_mbps`` then says only what tc held it to).
    transport: str | None = None
    # What a sweep over the frontier's methods varies beyond the mode (issues 34 and 38): the
    # inner optimizer, the wiring (and a swarm's routing), SparseLoCo's density, DeMo's top-k,
    # a periodic mode's fragments; null where the run has none of them.
    optimizer: str | None = None
    wiring: str | None = None
    routing: str | None = None
    sync_density: float | None = None
    sync_topk: int | None = None
    sync_fragments: int | None = None
    # The sweep's named row it ran (sweep.variants: its own overrides); null outside one.
    variant: str | None = None
    # The checkpoint whose weights it started from ("job-000029@500"; "@" and the step left
    # out where the leader took the newest); null: from the seeded initialisation.
    warm_start: str | None = None


FIELDS = attrs.fields(MetricsSummary)


def summary_json(summary: MetricsSummary) -> dict[str, Any]:
    """The JSON of ``metrics_summary.json``."""
    out: dict[str, Any] = unstructure(summary)
    return out


def as_summary(summary: MetricsSummary | Mapping[str, Any]) -> MetricsSummary:
    """A summary, from its JSON where that is what is at hand (ValueError naming the field)."""
    if isinstance(summary, MetricsSummary):
        return summary
    return parse_summary(summary)[0]


def _expects(name: str) -> str:
    f = attrs.fields_dict(MetricsSummary)[name]
    if f.metadata.get("expects"):
        return str(f.metadata["expects"])
    plain = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    (kind,) = [t for t in typing.get_args(typing.get_type_hints(MetricsSummary)[name])
               if t is not type(None)]
    return plain[kind]


def shown(value: Any) -> str:
    """A value as a damage line shows it: its JSON, cut at 40 characters."""
    text = jsonio.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def _damage(raw: Mapping[str, Any], exc: SchemaError) -> str:
    path = (exc.field or "$").removeprefix("$").removeprefix(".")
    name = path.split(".", 1)[0].split("[", 1)[0]
    if name not in attrs.fields_dict(MetricsSummary) or name not in raw:
        return str(exc)
    line = f"{name} is {shown(raw[name])}, not {_expects(name)}"
    inside = path[len(name):]
    if "." in inside:  # (in one of its objects: which, and what of it)
        line += f" ({path}: {exc.message})"
    return line


def parse_summary(raw: Any) -> tuple[MetricsSummary, frozenset[str]]:
    """A summary's JSON as the class, and the fields the JSON did not hold (a run from before
    them: a reader may look elsewhere for those). ValueError, in one line naming the field,
    for damage."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"holds {shown(raw)}, not a JSON object")
    try:
        summary = structure(dict(raw), MetricsSummary, strict=False)
    except SchemaError as exc:
        raise ValueError(_damage(raw, exc)) from None
    return summary, frozenset(f.name for f in FIELDS if f.name not in raw)
