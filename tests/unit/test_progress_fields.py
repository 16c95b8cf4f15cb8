"""``train_progress.ndjson`` writes every field of ProgressRecord but those it names as left out:
a figure added to the record reaches the run's file without a second list to remember, and
lines of the fields it always had read as they did."""

from __future__ import annotations

import attrs

from swarm_core import jsonio
from swarm_core.contract import CodecErrors, MembershipChange, ProgressRecord
from swarm_core.experiments import runner
from swarm_core.experiments.runner import PROGRESS_FIELDS, PROGRESS_NOT_WRITTEN, progress_line
from swarm_core.schema import unstructure

# A line's keys before they were derived from the class: files already written have them so.
WRITTEN_BEFORE = ("step", "loss", "tokens_per_s", "wire_bytes", "sync_bytes", "step_seconds",
                  "eval_loss", "perplexity", "lr", "activation_peak_bytes", "wait_seconds",
                  "stage_seconds", "codec_error", "ts")


def _full_record() -> ProgressRecord:
    """A record with every field set (none left at its default)."""
    return ProgressRecord(
        step=7, wire_bytes=1234, stages_reported=[0, 1], loss=2.5, sync_bytes=500,
        replica_losses={"0": 2.4, "1": 2.6}, tokens_per_s=900.0, step_seconds=0.5, lr=1e-3,
        activation_peak_bytes={"0.0": 5}, wait_seconds={"0.0": 0.1},
        stage_seconds={"0.0": 0.4}, codec_error={"0.0": CodecErrors(act=0.01, grad=0.02)},
        eval_loss=2.7, perplexity=14.9, ts=1.5e9,
        membership=[MembershipChange(step=7, epoch=1, members=[0, 2], left=[1])],
        slowdown={"1.0": 4.0}, micro_batches={"1.0": 6.0},
        replica_micro_batches={"0": 6.0, "1": 2.0})


def test_every_record_field_is_written_or_left_out_by_name():
    fields = [f.name for f in attrs.fields(ProgressRecord)]
    rec = _full_record()
    assert all(getattr(rec, f.name) != f.default for f in attrs.fields(ProgressRecord)
               if not isinstance(f.default, attrs.Factory))  # type: ignore[arg-type]
    assert set(PROGRESS_FIELDS) | PROGRESS_NOT_WRITTEN == set(fields)
    assert not set(PROGRESS_FIELDS) & PROGRESS_NOT_WRITTEN
    assert len(set(PROGRESS_FIELDS)) == len(PROGRESS_FIELDS)
    line = progress_line(rec)
    assert list(line) == list(PROGRESS_FIELDS)
    for name in PROGRESS_FIELDS:
        assert line[name] == unstructure(getattr(rec, name))
    jsonio.dumps(line)  # (a line is JSON as it stands)


def test_the_fields_lines_always_had_keep_their_order_and_values():
    rec = _full_record()
    line = progress_line(rec)
    assert PROGRESS_FIELDS[:len(WRITTEN_BEFORE)] == WRITTEN_BEFORE
    assert {k: line[k] for k in WRITTEN_BEFORE} == \
        {k: unstructure(getattr(rec, k)) for k in WRITTEN_BEFORE}
    # A step a record lacks a figure of is null there, as before.
    bare = progress_line(ProgressRecord(step=1))
    assert bare["step"] == 1 and bare["loss"] is None and bare["replica_losses"] is None


def test_a_field_added_to_the_record_is_written(monkeypatch):
    @attrs.define
    class Grown(ProgressRecord):
        new_figure: float | None = None

    monkeypatch.setattr(runner, "ProgressRecord", Grown)
    fields = runner._progress_fields()
    assert fields[-1] == "new_figure"
    assert fields[:-1] == PROGRESS_FIELDS


def test_metric_names_are_the_record_fields_and_spelled_nowhere_else():
    """One spelling of a step's figures (``MetricName``, read off ProgressRecord): the run
    log, the trackers and the leader's series take the names from it, so a module that reads
    a line by name cannot drift from the record that writes it."""
    import re

    from swarm_core.contract.metrics import MetricName
    from tests.support import REPO

    names = {k: v for k, v in vars(MetricName).items() if k.isupper()}
    assert sorted(names.values()) == sorted(f.name for f in attrs.fields(ProgressRecord))
    assert all(k == v.upper() for k, v in names.items())
    # The figures a step's line keys by stage were written as text in two modules before.
    by_stage = ("activation_peak_bytes", "codec_error", "wait_seconds", "stage_seconds")
    for rel in ("swarm_core/experiments/runner.py", "swarm_core/tracking/names.py",
                "swarm_core/leader/progress.py"):
        text = (REPO / rel).read_text()
        spelled = [n for n in by_stage if re.search(rf"[\"']{n}[\"']", text)]
        assert not spelled, f"{rel} spells {spelled}: use MetricName"


def test_a_swarm_step_s_loss_weighs_each_replica_by_the_micro_batches_it_ran():
    """Swarm wiring deals a step's micro-batches unevenly: each replica's loss is the mean over
    its own, so the step's is their mean weighted by them (the whole batch's mean); with a
    report missing, the mean over the micro-batches reported, not a share taken for all."""
    rec = ProgressRecord(step=3)
    rec.add_replica_loss(0, 2.0, 6.0)
    assert rec.loss == 2.0  # (replica 1's report not in yet)
    rec.add_replica_loss(1, 4.0, 2.0)
    assert rec.loss == (2.0 * 6 + 4.0 * 2) / 8 and rec.replica_micro_batches == {"0": 6.0,
                                                                                 "1": 2.0}
    chain = ProgressRecord(step=3)  # (chains run equal shares: the plain mean)
    chain.add_replica_loss(0, 2.0)
    chain.add_replica_loss(1, 4.0)
    assert chain.loss == 3.0 and chain.replica_micro_batches is None
