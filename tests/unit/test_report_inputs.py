"""``swarm report`` over run directories whose files are damaged (half-written, hand-edited, from
an older version): each unreadable run is left out with one line on stderr that names the file
and what is wrong, the rest are reported, and the exit code says the report is not complete.
The run directories are written by the sweep runner itself, against a stand-in leader."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from swarm_core.config.profiles import load_experiment
from swarm_core.contract import JobInfo, JobMetrics, ProgressRecord, Topology
from swarm_core.experiments.runner import Experiment
from swarm_core.protocol import FellowStatus
from swarm_core.schema import structure
from swarm_tui.cli import run
from swarm_tui.commands.base import ExitCode

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Leader:
    """Just what the sweep runner asks of a leader: every job it queues completes at once,
    with ``records`` as its progress."""

    base_url = "http://127.0.0.1:9"

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.queued: list[str] = []

    async def fellows(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(fellow_id=i, name=f"f{i}", host="h", devices=["cpu"],
                                status=FellowStatus.READY) for i in range(2)]

    async def submit(self, body: Any) -> SimpleNamespace:
        self.queued.append(f"job-{len(self.queued) + 1:06d}")
        return SimpleNamespace(job_id=self.queued[-1], state="QUEUED", waiting_for="")

    async def jobs(self, state: str | None = None) -> list[JobInfo]:
        jobs = [await self.job(j) for j in self.queued]
        return [j for j in jobs if state is None or j.state == state]

    async def job(self, job_id: str) -> JobInfo:
        last = self.records[-1]
        return JobInfo(
            job_id=job_id, name=job_id, kind="train", state="COMPLETED", created_at=0.0,
            started_at=1.0, finished_at=10.0, last_step=last["step"], last_loss=last["loss"],
            fellows=[0, 1], topology=Topology(2), reason="",
            metrics=JobMetrics(eval_loss=2.5, tokens_per_s=1000.0))

    async def progress(self, job_id: str) -> list[ProgressRecord]:
        return structure(self.records, list[ProgressRecord])


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    """A finished two-run sweep (compressions none and fixed_int8) under tmp_path/runs."""
    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "tiny.json").write_text(json.dumps(
        {"name": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 3, "batch_size": 4, "micro_batches": 2, "cluster_profile": {"fellows": 2},
         "artifacts": {"runs_dir": "../runs"}}))
    cfg = tmp_path / "exp.json"
    cfg.write_text(json.dumps({"name": "rep", "training_config": "training/t.json",
                               "model_configs": ["model/tiny.json"],
                               "sweep": {"compressions": ["none", "fixed_int8"]}}))
    records = [{"step": s, "loss": 4.0 - s, "wire_bytes": 100, "ts": 100.0 + s}
               for s in (1, 2, 3)]
    runner = Experiment(_Leader(records), load_experiment(cfg), on_line=lambda _: None,
                        poll_s=0.0, stamp="20260101T000000")

    async def sweep() -> None:
        await runner.start()
        await runner.run()

    asyncio.run(sweep())
    dirs = [st.run_dir for st in runner.states]
    assert [d.parent for d in dirs] == [tmp_path / "runs"] * 2
    assert all((d / "metrics_summary.json").exists() for d in dirs)
    return dirs


def _edit_summary(**fields: Any) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        path = d / "metrics_summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return damage


def _append_line(line: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        with open(d / "train_progress.ndjson", "a") as fh:
            fh.write(line + "\n")
    return damage


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


# damage to a run directory -> what the one line says after the directory
DAMAGE = {
    "summary is a list": (_write("metrics_summary.json", "[]"),
                          "/metrics_summary.json holds [], not a JSON object"),
    "summary is not JSON": (_write("metrics_summary.json", '{"status": "COMPL'),
                            "/metrics_summary.json is not valid JSON: unexpected end of data: "
                            "line 1 column 18 (char 17)"),
    "final_loss a string": (_edit_summary(final_loss="x"),
                            '/metrics_summary.json: final_loss is "x", not a number'),
    "eval_loss a bool": (_edit_summary(eval_loss=True),
                         "/metrics_summary.json: eval_loss is true, not a number"),
    "run_id a number": (_edit_summary(run_id=5),
                        "/metrics_summary.json: run_id is 5, not a string"),
    "link_changes a number": (_edit_summary(link_changes=5),
                              "/metrics_summary.json: link_changes is 5, not a list of "
                              "objects with an integer at_step"),
    "wait fractions of strings": (_edit_summary(wait_fraction_by_stage=["a", None]),
                                  '/metrics_summary.json: wait_fraction_by_stage is '
                                  '["a",null], not a list of numbers by stage'),
    "progress line a list": (_append_line("[1,2]"),
                             "/train_progress.ndjson line 4 holds [1,2], not a JSON object"),
    "progress step and loss strings": (_append_line('{"step":"x","loss":"y"}'),
                                       '/train_progress.ndjson line 4: step is "x", not a '
                                       "number from 0 to 2**63-1"),
    "progress loss a string": (_append_line('{"step":4,"loss":"y"}'),
                               '/train_progress.ndjson line 4: loss is "y", not a number '
                               "within float32's range"),
    "progress step past int64": (_append_line('{"step":1e308,"loss":1.0}'),
                                 "/train_progress.ndjson line 4: step is 1e+308, not a number "
                                 "from 0 to 2**63-1"),
    "progress loss past float32": (_append_line('{"step":4,"loss":-1e300}'),
                                   "/train_progress.ndjson line 4: loss is -1e+300, not a "
                                   "number within float32's range"),
    "progress loss without step": (_append_line('{"loss":1.0}'),
                                   "/train_progress.ndjson line 4 has a loss but no step"),
    "progress line cut short": (_append_line('{"step":4,"lo'),
                                "/train_progress.ndjson line 4 is not JSON"),
    "progress missing": (lambda d: (d / "train_progress.ndjson").unlink(),
                         ": not a finished run directory (missing train_progress.ndjson)"),
}


def _lines(text: str) -> list[str]:
    return text.strip().splitlines()


@pytest.mark.parametrize("fmt", ["table", "json", "html"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_run_is_left_out_named_in_one_line_and_exits_1(runs, case, fmt, capsys):
    damage, says = DAMAGE[case]
    good, bad = runs
    damage(bad)
    out = good.parent.parent / "report" / "r.html"
    argv = ["report", str(good.parent)] + {"table": [], "json": ["--format", "json"],
                                           "html": ["--output", str(out)]}[fmt]
    assert run(argv) == ExitCode.FAILURE
    captured = capsys.readouterr()
    assert _lines(captured.err) == [f"skipped {bad}{says}"]
    if fmt == "json":
        doc = json.loads(captured.out)
        assert [r["run_dir"] for r in doc["runs"]] == [str(good)]
        assert [s["run_dir"] for s in doc["skipped"]] == [str(bad)]
        assert f"skipped {doc['skipped'][0]['error']}" == _lines(captured.err)[0]
    else:
        assert "tiny-none-" in captured.out and "tiny-fixed_int8" not in captured.out
    if fmt == "html":
        html = out.read_text()
        assert html.count("<polyline") == 3  # one line per chart: the readable run's
        assert str(good) in html and str(bad) not in html


@pytest.mark.parametrize("case", ["summary is a list", "final_loss a string",
                                  "progress line a list", "progress step and loss strings"])
@pytest.mark.parametrize("fmt", ["table", "json", "html", "png"])
def test_a_damaged_run_alone_is_a_one_line_error_that_writes_nothing(runs, case, fmt, capsys):
    damage, says = DAMAGE[case]
    bad = runs[1]
    damage(bad)
    out = bad.parent.parent / "report" / f"r.{fmt}"
    extra = {"table": [], "json": ["--format", "json"]}.get(fmt, ["--output", str(out)])
    assert run(["report", str(bad), *extra]) == ExitCode.FAILURE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _lines(captured.err) == [f"swarm: {bad}{says}"]
    assert not out.parent.exists()


def test_when_no_run_can_be_read_each_is_named_and_nothing_is_written(runs, capsys):
    DAMAGE["summary is a list"][0](runs[0])
    DAMAGE["progress line a list"][0](runs[1])
    out = runs[0].parent.parent / "r.html"
    assert run(["report", str(runs[0].parent), "--output", str(out)]) == ExitCode.FAILURE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _lines(captured.err) == [
        f"skipped {runs[0]}/metrics_summary.json holds [], not a JSON object",
        f"skipped {runs[1]}/train_progress.ndjson line 4 holds [1,2], not a JSON object",
        "swarm: none of the 2 run directories could be read"]
    assert not out.exists()


def test_undamaged_runs_report_with_exit_0_and_nothing_on_stderr(runs, capsys):
    # A blank line (a hand edit) is no record, and no damage.
    _append_line("")(runs[0])
    out = runs[0].parent.parent / "new" / "dir" / "r.html"
    assert run(["report", *map(str, runs), "--output", str(out)]) == ExitCode.OK
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "tiny-none-" in captured.out and "tiny-fixed_int8-" in captured.out
    assert _lines(captured.out)[-1] == f"wrote {out}"
    assert out.read_text().count("<polyline") == 6
    assert run(["report", str(runs[0].parent), "--format", "json"]) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    assert [r["run_dir"] for r in doc["runs"]] == list(map(str, runs))
    assert doc["skipped"] == []


def test_a_diverged_run_is_reported_not_skipped(runs, capsys):
    """NaN losses and codec errors (a diverged run: a finding) reach JSON as null."""
    _edit_summary(final_loss=None, codec_error_by_stage=[{"act": None, "grad": None}, None])(
        runs[0])
    assert run(["report", *map(str, runs), "--format", "json"]) == ExitCode.OK
    captured = capsys.readouterr()
    assert captured.err == ""
    doc = json.loads(captured.out)
    assert doc["skipped"] == [] and len(doc["runs"]) == 2


def test_a_path_that_is_no_directory_is_an_error_before_anything_is_written(runs, capsys):
    out = runs[0].parent.parent / "r.html"
    missing = runs[0].parent / "no-such-run"
    assert run(["report", str(runs[0]), str(missing), "--output", str(out)]) \
        == ExitCode.FAILURE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _lines(captured.err) == [
        f"swarm: {missing}: no such directory (give run directories, or a folder of them)"]
    assert not out.exists()


def test_a_folder_with_no_finished_run_is_named_among_the_others(runs, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(["report", str(runs[0]), str(empty)]) == ExitCode.FAILURE
    captured = capsys.readouterr()
    assert _lines(captured.err) == [
        f"skipped {empty}: not a finished run directory (missing metrics_summary.json)"]
    assert "tiny-none-" in captured.out


@pytest.mark.parametrize("where", ["parent is a file", "below a file", "is a directory"])
def test_an_output_that_cannot_be_written_is_a_usage_error(runs, tmp_path, where, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    (tmp_path / "d.html").mkdir()
    out, says = {"parent is a file": (a_file / "r.html", f"--output: {a_file} is not a "
                                                         "directory"),
                 "below a file": (a_file / "x" / "r.png", f"--output: {a_file} is not a "
                                                          "directory"),
                 "is a directory": (tmp_path / "d.html", f"--output: {tmp_path / 'd.html'} "
                                                         "is a directory")}[where]
    assert run(["report", str(runs[0]), "--output", str(out)]) == ExitCode.USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _lines(captured.err) == [f"swarm: {says}"]
    assert a_file.read_text() == "x" and list((tmp_path / "d.html").iterdir()) == []


def test_a_png_goes_where_it_is_asked_and_says_nothing_on_stderr(runs, capsys):
    """Steps and bytes up to int64, losses up to float32's limit, and run names that
    matplotlib would otherwise read as markup ("$", a leading "_") or lack glyphs for, make a
    PNG with nothing on stderr."""
    _edit_summary(run_id="_hidden")(runs[0])
    _edit_summary(run_id=r"$\foo$ 日本")(runs[1])
    (runs[0] / "train_progress.ndjson").write_text("".join(
        json.dumps({"step": s, "loss": loss, "wire_bytes": 2**63 - 1, "ts": t}) + "\n"
        for s, loss, t in ((1, 3.4e38, 1.0), (2**63 - 1, -3.4e38, 2.0**62))))
    out = runs[0].parent.parent / "made" / "here" / "r.png"
    assert run(["report", str(runs[0].parent), "--output", str(out)]) == ExitCode.OK
    captured = capsys.readouterr()
    assert captured.err == ""
    assert _lines(captured.out)[-1] == f"wrote {out}"
    assert out.read_bytes().startswith(PNG_MAGIC)
