"""Slow peers, emulated (swarm_core.pipeline.pace): a stage's compute padded to X times its
measured time, set at a fellow's start and live by SET_SPEED, and named in its reports."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.pace import SLICE_S, Pace
from swarm_core.protocol import LinkLimits, Signal


async def test_padding_makes_a_stages_compute_about_x_times(make_start):
    """In-process, one stage of a tiny model: the padding slept (X - 1) times the compute it
    measured, the steps took about X times that compute, and each step's report and the run's
    figures name the emulated factor."""
    from swarm_core.fellow.jobs import JobContext, Progress
    from swarm_core.fellow.train import run_train

    reports: list[Any] = []

    async def report(update: Any) -> None:
        reports.append(update)

    pace = Pace(3.0)
    start = make_start(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                       {"steps": 3, "batch_size": 4, "micro_batches": 2, "eval_batches": 0})
    ctx = JobContext(fellow_id=0, progress=Progress(), report=report, shaper=LinkShaper(),
                     pace=pace)
    await run_train(start, ctx)
    assert reports[-1].state == "COMPLETED"
    assert pace.compute_s > 0
    # What it asked to sleep is (X - 1) x what it measured, op by op.
    assert pace.padded_s == pytest.approx(2.0 * pace.compute_s, rel=1e-9)
    steps = [r.metrics for r in reports if r.state == "RUNNING" and r.metrics is not None
             and r.metrics.step_seconds is not None]
    assert len(steps) == 3
    assert all(m.slowdown == 3.0 for m in steps)
    # The sleep happened: the steps' wall time holds the compute and its padding (loose: the
    # step has work outside its ops, and a sleep may overrun but not fall short).
    wall = sum(m.step_seconds for m in steps)
    assert wall >= 0.95 * 3.0 * pace.compute_s
    assert reports[-1].metrics.slowdown == 3.0, "the run's figures name the emulation"


async def test_an_unslowed_stage_reports_no_slowdown(make_start):
    from swarm_core.fellow.jobs import JobContext, Progress
    from swarm_core.fellow.train import run_train

    reports: list[Any] = []

    async def report(update: Any) -> None:
        reports.append(update)

    pace = Pace()  # X = 1: none
    start = make_start(dict(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                       {"steps": 1, "batch_size": 4, "micro_batches": 2, "eval_batches": 0})
    await run_train(start, JobContext(fellow_id=0, progress=Progress(), report=report,
                                      shaper=LinkShaper(), pace=pace))
    assert reports[-1].state == "COMPLETED"
    assert pace.padded_s == 0.0
    assert all(r.metrics is None or r.metrics.slowdown is None for r in reports)


@pytest.mark.parametrize("bad", [0.5, 0.0, 100.5, float("nan")])
def test_a_pace_refuses_a_factor_out_of_range(bad):
    with pytest.raises(ValueError, match="slowdown must be between 1 and 100"):
        Pace(bad)


def test_a_pad_ends_within_a_slice_of_a_stop():
    """A stage told to stop does not sleep out a long pad: the stop check runs each slice."""
    stop = threading.Event()
    checks: list[float] = []

    def check() -> None:
        checks.append(time.monotonic())
        if len(checks) == 2:
            stop.set()

    t0 = time.monotonic()
    asked = Pace(100.0).pad(10.0, stop, check)  # 990 s asked
    assert asked == pytest.approx(990.0)
    assert time.monotonic() - t0 < 3 * SLICE_S


def test_the_summary_keeps_each_cells_largest_slowdown():
    from swarm_core.contract import ProgressRecord
    from swarm_core.experiments.runner import slowdown_by_cell

    records = [ProgressRecord(step=1, slowdown={"1": 2.0}),
               ProgressRecord(step=2, slowdown={"1": 4.0, "0": 1.5}),
               ProgressRecord(step=3)]
    assert slowdown_by_cell(records) == {"1": 4.0, "0": 1.5}
    assert slowdown_by_cell([ProgressRecord(step=1)]) is None


def _daemon() -> Any:
    from swarm_core.fellow.daemon import FellowDaemon, FellowOptions

    return FellowDaemon(FellowOptions(leader_url="http://127.0.0.1:9", token="t",
                                      slowdown=2.0))


async def test_a_set_speed_signal_sets_the_slowdown_and_leaves_the_link_alone():
    """A slowdown-only SET_SPEED changes the pace the fellow's stages read before their next
    op, and not its link; one with both sets both; the fellow's --slowdown is its start."""
    d = _daemon()
    assert d.pace.slowdown == 2.0
    d.links.set_speed(LinkLimits(tx_mbps=8.0))
    await d.apply(Signal(seq=1, kind="SET_SPEED", payload={"slowdown": 4.0}))
    assert d.pace.slowdown == 4.0
    assert d.shaper.limits() == LinkLimits(tx_mbps=8.0)
    await d.apply(Signal(seq=2, kind="SET_SPEED", payload={
        "tx_mbps": None, "rx_mbps": 3.0, "latency_ms": 0.0, "slowdown": 1.0}))
    assert d.pace.slowdown == 1.0
    assert d.shaper.limits() == LinkLimits(rx_mbps=3.0)
    # A link alone (a leader before slowdown) leaves the pace as it is.
    await d.apply(Signal(seq=3, kind="SET_SPEED", payload={"tx_mbps": 5.0}))
    assert d.pace.slowdown == 1.0 and d.shaper.limits() == LinkLimits(tx_mbps=5.0)


async def test_a_bad_slowdown_in_a_signal_changes_nothing(caplog):
    d = _daemon()
    await d.apply(Signal(seq=1, kind="SET_SPEED", payload={"tx_mbps": 9.0, "slowdown": 0.5}))
    assert d.pace.slowdown == 2.0
    assert d.shaper.limits() == LinkLimits()
    assert "ignoring bad SET_SPEED payload" in caplog.text


def test_the_fellows_stages_get_its_pace():
    """Every stage the fellow runs reads the one Pace that SET_SPEED changes."""
    from swarm_core.fellow.jobs import Progress

    d = _daemon()
    d.fellow_id = 0
    ctx = d._context("job-1", Progress(job_id="job-1"))
    assert ctx.pace is d.pace


def test_the_consoles_speed_form_reads_a_slowdown():
    """The set-speed dialog's slowdown field: empty leaves it unchanged, a number in 1-100 is
    sent, anything else is a one-line error naming the field."""
    from swarm_tui.app.forms import FormError, parse_speed

    assert parse_speed("", "", "").slowdown is None
    assert parse_speed("8", "", "", " 4 ").slowdown == 4.0
    for bad, says in (("0.5", "out of range (1 to 100; leave it empty for unchanged)"),
                      ("fast", "is not a number")):
        with pytest.raises(FormError) as exc:
            parse_speed("", "", "", bad)
        assert exc.value.field == "slowdown"
        assert str(exc.value).startswith("slowdown x: ") and says in str(exc.value)
