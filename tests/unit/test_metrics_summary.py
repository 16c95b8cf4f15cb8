"""A run's metrics_summary.json as a class (swarm_core/experiments/summary.py): the runner
writes it from MetricsSummary with the keys and values it always had, and its readers read it
back through the project's structuring, damage named in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from swarm_core.contract import (
    CodecErrors,
    JobInfo,
    LinkChange,
    MembershipChange,
    ProgressRecord,
    Restart,
    Topology,
)
from swarm_core.experiments.report import ReportError, load_run, read_summary
from swarm_core.experiments.runner import build_summary, summarize
from swarm_core.experiments.summary import MetricsSummary, parse_summary, summary_json
from swarm_core.protocol import LinkLimits
from swarm_core.schema import json_schema

MODEL = {"name": "m", "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}

# The keys, in order, the runner wrote when it built the summary as a dict.
KEYS = ["run_id", "job_id", "status", "reason", "steps_expected", "steps_recorded",
        "final_loss", "best_loss", "eval_loss", "perplexity", "wall_time_s", "tokens_per_s",
        "wire_bytes_per_step", "expected_wire_bytes_per_step",
        "uncompressed_wire_bytes_per_step", "compression_ratio", "compression",
        "network_profile", "link_mbps", "latency_ms", "model", "seed", "repeat", "fellows",
        "stages", "replicas", "sync_mode", "inner_steps", "overlap_steps", "sync_compression",
        "sync_bytes_per_step", "sync_bytes_total", "total_bytes",
        "activation_peak_bytes_by_stage", "wait_fraction_by_stage", "codec_error_by_stage",
        "link_changes", "link_changes_total", "restarts", "membership", "thresholds",
        "thresholds_met"]
# Added since, after them: the boundary's planned bytes each way and the ratio to none.
ADDED = ["act_bytes_per_step", "grad_bytes_per_step", "boundary_ratio",
         "emulated_slowdown_by_cell", "transport", "optimizer", "wiring", "routing",
         "sync_density", "sync_topk", "sync_fragments", "variant", "warm_start"]


def _run() -> tuple[Any, JobInfo, list[ProgressRecord]]:
    st = SimpleNamespace(run_id="r", spec=SimpleNamespace(
        model=MODEL, training={"steps": 2, "max_final_loss": 5.0}, fellows=2,
        compression="none", network={"name": "slow", "tx_mbps": 80, "latency_ms": 20},
        stages=2, replicas=1, sync_mode="none", seed=3, repeat=0, wiring={}, variant=None))
    job = JobInfo(
        job_id="job-000001", name="r", kind="train", state="COMPLETED", created_at=0.0,
        started_at=10.0, finished_at=12.5, last_step=2, last_loss=2.9, fellows=[0, 1],
        topology=Topology(2), reason="",
        link_changes=[LinkChange(at_step=1, fellow_id=1, link=LinkLimits(tx_mbps=8.0), at=1.0)],
        link_changes_total=1,
        restarts=[Restart(at_step=2, resume_step=1, reason="fellow 1 lost", at=2.0)],
        membership=[MembershipChange(step=2, epoch=1, members=[0])])
    records = [ProgressRecord(step=s, loss=3.0 - s / 10, wire_bytes=100, ts=10.0 + s,
                              activation_peak_bytes={"0": 70 * s, "1": 50},
                              wait_seconds={"0": 0.1, "1": 0.2},
                              stage_seconds={"0": 1.0, "1": 1.0},
                              codec_error={"0": CodecErrors(act=0.01), "1": CodecErrors(grad=0.02)})
               for s in (1, 2, 3)]
    return st, job, records


def test_the_summary_is_written_from_the_class_with_the_keys_it_always_had() -> None:
    st, job, records = _run()
    summary = build_summary(st, job, records)
    assert isinstance(summary, MetricsSummary)
    written = summarize(st, job, records)
    assert list(written) == KEYS + ADDED
    assert written == summary_json(summary)
    # Each value as the dict held it: byte counts as counted, objects as their JSON.
    assert written["wire_bytes_per_step"] == 100.0 and written["total_bytes"] == 300
    assert written["link_mbps"] == 80.0 and written["latency_ms"] == 20
    assert written["activation_peak_bytes_by_stage"] == [210, 50]
    assert written["codec_error_by_stage"] == [{"act": pytest.approx(0.01)},
                                               {"grad": pytest.approx(0.02)}]
    assert written["link_changes"] == [{"at_step": 1, "fellow_id": 1, "at": 1.0, "link": {
        "tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 0.0}}]
    assert written["restarts"][0]["resume_step"] == 1
    assert written["thresholds"] == {"max_final_loss": {"limit": 5.0, "value": 2.7,
                                                        "met": True}}
    assert written["thresholds_met"] is True and written["sync_mode"] == "none"
    # d=16, seq 8, the default batch 8 in 4 micro-batches of 2, fp32 ``none``: 4 frames
    # each way.
    frame = 64 + 2 * 8 * 16 * 4
    assert (written["act_bytes_per_step"], written["grad_bytes_per_step"]) == (4 * frame,
                                                                               4 * frame)
    assert written["boundary_ratio"] == 1.0
    # What a frontier sweep varies: a chain of one replica under AdamW has no sync figures.
    assert (written["optimizer"], written["wiring"], written["routing"]) == ("adamw", "chain",
                                                                           None)
    assert [written[k] for k in ("sync_density", "sync_topk", "sync_fragments")] == [None] * 3
    # And it reads back to the class it was written from, every field there.
    again, absent = parse_summary(json.loads(json.dumps(written)))
    assert again == summary and absent == frozenset()


@pytest.mark.parametrize("mode, sync, expected", [
    ("sparseloco", {"inner_steps": 10, "density": 0.05, "fragments": 2}, (0.05, None, 2)),
    ("demo", {"topk": 16}, (None, 16, None)),
    ("diloco", {"inner_steps": 4}, (None, None, 1)),
])
def test_the_summary_says_the_sync_s_own_knobs(mode, sync, expected) -> None:
    """SparseLoCo's density, DeMo's top-k and a periodic mode's fragments, so a sweep over
    them reads apart in its table."""
    st, job, records = _run()
    st.spec.replicas, st.spec.sync_mode = 2, mode
    st.spec.training = {"steps": 2, "sync": {"mode": mode, **sync}}
    written = summarize(st, job, records)
    assert (written["sync_density"], written["sync_topk"], written["sync_fragments"]) == \
        expected


def test_an_older_summary_reads_with_its_absent_fields_named_and_unknown_keys_ignored(
        tmp_path) -> None:
    (tmp_path / "metrics_summary.json").write_text(json.dumps(
        {"run_id": "old", "final_loss": 2.5, "a_newer_field": [1]}))
    summary, absent = parse_summary(json.loads((tmp_path / "metrics_summary.json").read_text()))
    assert summary == MetricsSummary(run_id="old", final_loss=2.5)
    assert "link_mbps" in absent and "run_id" not in absent
    assert read_summary(tmp_path) == summary


@pytest.mark.parametrize(("fields", "says"), [
    ({"steps_recorded": 2.5}, "steps_recorded is 2.5, not an integer"),
    ({"thresholds_met": "yes"}, 'thresholds_met is "yes", not true or false'),
    ({"activation_peak_bytes_by_stage": [1, "x"]},
     'activation_peak_bytes_by_stage is [1,"x"], not a list of integers by stage'),
    # In one of its objects: the path says which, and what of it.
    ({"link_changes": [{"at_step": 3, "fellow_id": 1, "at": 0.0, "link": {"tx_mbps": "x"}}]},
     'link_changes is [{"at_step":3,"fellow_id":1,"at":0.0,..., not a list of objects '
     "with an integer at_step (link_changes[0].link.tx_mbps: expected a number, got a string)"),
    ({"thresholds": {"max_final_loss": {"limit": 1.0, "value": None}}},
     'thresholds is {"max_final_loss":{"limit":1.0,"value..., not an object of '
     "{limit, value, met} by figure (thresholds.max_final_loss.met: required field missing)"),
])
def test_a_damaged_field_is_one_line_naming_it_its_value_and_what_it_should_be(
        tmp_path, fields: dict[str, Any], says: str) -> None:
    (tmp_path / "metrics_summary.json").write_text(json.dumps({"run_id": "r", **fields}))
    with pytest.raises(ReportError) as info:
        load_run(tmp_path)
    assert str(info.value) == f"{tmp_path}/metrics_summary.json: {says}"


def test_the_summary_class_has_a_json_schema() -> None:
    components: dict[str, Any] = {}
    json_schema(MetricsSummary, components)
    schema = components["MetricsSummary"]
    assert list(schema["properties"]) == KEYS + ADDED and "required" not in schema
    assert schema["properties"]["sync_mode"]["enum"] == ["none", "dp", "diloco", "sparseloco",
                                                         "demo"]
