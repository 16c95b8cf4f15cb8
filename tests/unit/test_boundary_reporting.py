"""What a run says of its boundaries (issue "Pipeline boundaries at the field's frontier",
point 3): the bytes per step forward and backward as planned, checked against what each
direction's sender measured; the ratio to fp32 ``none`` at the same shapes; the codec error of
what the receiver actually decoded (a stochastically rounded gradient's included); and each in
the run summary, ``swarm job`` and the frontier figure's config."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.data import load_token_data
from swarm_core.pipeline import codecs, stage
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.wire_math import step_boundary_bytes, uncompressed_model
from swarm_core.schema import structure

MODEL = dict(d_model=32, n_layers=2, n_heads=2, seq_len=16)
TRAINING = dict(steps=2, batch_size=4, micro_batches=2, eval_every=0, eval_batches=0,
                shard_push_interval_steps=0, warmup_steps=1)
NORM_FRAME = HEADER_SIZE + 8  # the clip's float64 a stage sends each neighbour per step


def _configs(spec: str) -> tuple[ModelConfig, TrainingConfig]:
    return (structure({**MODEL, "compression": spec}, ModelConfig),
            structure(TRAINING, TrainingConfig))


def _run(spec: str, **kwargs: Any) -> dict[int, Any]:
    mc, tc = _configs(spec)
    res = run_local_pipeline(mc, tc, load_token_data(tc, mc.seq_len), 2, timeout=120, **kwargs)
    for r in res.values():
        assert not isinstance(r, BaseException), r
    return res


@pytest.mark.parametrize("spec", ["none", "fixed_int8", "hadamard_int2_b16", "subspace_k8_int8",
                                  "learned_dim8_int8"])
def test_each_directions_planned_bytes_are_what_its_sender_measured(spec):
    """Two stages: stage 0 sends only ACT frames (and its clip norm), stage 1 only GRAD
    frames (and its): each measured figure is its direction's plan plus one NORM frame."""
    mc, tc = _configs(spec)
    act, grad = step_boundary_bytes(mc, tc, 2)
    res = _run(spec)
    assert res[0].metrics.wire_tx_bytes_per_step == act + NORM_FRAME
    assert res[1].metrics.wire_tx_bytes_per_step == grad + NORM_FRAME


def test_the_ratio_to_none_divides_fp32_nones_bytes_at_the_same_shapes():
    """d=32, seq 16, micro-batches of 2: ``none`` sends 2*16*32 fp32 values a frame;
    ``subspace_k8_int8`` 2*16 rows of 8 int8 codes and a float32 scale each."""
    mc, tc = _configs("subspace_k8_int8")
    frames = tc.micro_batches  # (one boundary, each way)
    plain = frames * (HEADER_SIZE + 2 * 16 * 32 * 4)
    coded = frames * (HEADER_SIZE + 2 * 16 * (8 + 4))
    assert step_boundary_bytes(uncompressed_model(mc), tc, 2) == (plain, plain)
    assert step_boundary_bytes(mc, tc, 2) == (coded, coded)
    assert step_boundary_bytes(mc, tc, 4) == (3 * coded, 3 * coded)
    assert uncompressed_model(mc).compression == "none"
    assert uncompressed_model(mc).wire_dtype == "fp32"


def test_the_reported_grad_error_is_that_of_what_the_receiver_decodes(monkeypatch):
    """``hadamard_int4``'s backward rounds stochastically: the stage's reported GRAD error is
    that of the frame it sent, decoded as the receiver decodes it, which is larger than the
    wire format's round-to-nearest round trip of the same gradient (the error reported
    before: about 1/sqrt(2) of it)."""
    seen: list[tuple[str, torch.Tensor, float, float]] = []
    real = stage.decoded_error

    def watch(x: torch.Tensor, bufs: list[memoryview], wire: codecs.WireCodec) -> float:
        got = real(x, bufs, wire)
        decoded = codecs.decode(bytearray().join(bufs), tuple(x.shape), wire.codec,
                                block=wire.block)
        own = float((decoded - x.detach()).norm() / x.detach().norm())
        # (stage 0 measures its activations, which carry grad; stage 1 a gradient)
        seen.append(("ACT" if x.requires_grad else "GRAD", x.detach().clone(), got, own))
        return got

    monkeypatch.setattr(stage, "decoded_error", watch)
    reported: list[float] = []
    res = _run("hadamard_int4_b16",
               on_step=lambda s, r: reported.append(r.codec_error.grad) if s == 1 else None)
    acts = [e for e in seen if e[0] == "ACT"]
    grads = [e for e in seen if e[0] == "GRAD"]
    assert len(acts) == len(grads) == TRAINING["steps"]
    for _kind, _x, got, own in seen:
        assert got == pytest.approx(own)
    assert reported == pytest.approx([got for _k, _x, got, _o in grads])
    assert res[1].metrics.codec_error.grad == pytest.approx(sum(reported) / len(reported))
    wire = codecs.WireCodec(codecs.Codec.HADAMARD_INT4, 16)
    for _kind, x, got, _own in grads:
        assert got > 1.2 * wire.relative_error(x)
    for _kind, x, got, _own in acts:  # (the forward rounds to nearest: its round trip)
        assert got == pytest.approx(wire.relative_error(x))


def test_the_summary_gives_each_directions_bytes_and_the_ratio_to_none(tmp_path):
    """From the frontier figure's own config: d=256, seq 128, batch 16 in 4 micro-batches,
    at 2 and 4 stages."""
    from swarm_core.config.profiles import load_experiment
    from swarm_core.contract import JobInfo, ProgressRecord, Topology
    from swarm_core.experiments.runner import summarize

    runs = load_experiment(Path(__file__).parents[2] / "exp" / "configs"
                           / "exp_boundary_frontier_v1.json").runs
    none_frame = HEADER_SIZE + 4 * 128 * 256 * 4
    k8_frame = HEADER_SIZE + 4 * 128 * (8 + 4)

    class St:
        run_id = "r"

    for stages in (2, 4):
        job = JobInfo(job_id="job-000001", name="r", kind="train", state="COMPLETED",
                      created_at=0.0, started_at=None, finished_at=None, last_step=1,
                      last_loss=3.0, fellows=list(range(stages)),
                      topology=Topology(stages=stages), reason="")
        for spec, frame in (("none", none_frame), ("subspace_k8_int8", k8_frame)):
            st = St()
            st.spec = next(r for r in runs if r.compression == spec  # type: ignore[attr-defined]
                           and r.stages == stages and r.seed == 0)
            s = summarize(st, job, [ProgressRecord(step=1, loss=3.0, wire_bytes=10)])  # type: ignore[arg-type]
            planned = (stages - 1) * 4 * frame
            assert (s["act_bytes_per_step"], s["grad_bytes_per_step"]) == (planned, planned)
            assert s["boundary_ratio"] == pytest.approx(none_frame / frame)


def test_the_frontier_figure_asks_for_the_issues_runs():
    """exp_boundary_frontier_v1: byte-level shakespeare, d=256, 8 layers, 2 and 4 stages,
    the issue's eight specs, 3 seeds, 80 Mbit/s links: 48 runs, each once."""
    from swarm_core.config.profiles import load_experiment
    from swarm_core.experiments.report import link_mbps

    exp = load_experiment(Path(__file__).parents[2] / "exp" / "configs"
                          / "exp_boundary_frontier_v1.json")
    specs = ["none", "fixed_int8", "learned_dim64_int8", "hadamard_int4_b64",
             "hadamard_int2_b64", "subspace_k16", "subspace_k16_int8", "subspace_k8_int8"]
    got = sorted((r.compression, r.stages, r.replicas, r.seed) for r in exp.runs)
    assert got == sorted((c, k, 1, s) for c in specs for k in (2, 4) for s in (0, 1, 2))
    assert len({r.run_name for r in exp.runs}) == len(exp.runs) == 48
    for r in exp.runs:
        assert {k: r.model[k] for k in ("d_model", "n_layers")} == {"d_model": 256,
                                                                     "n_layers": 8}
        assert (r.training["dataset"], r.training["tokenizer"]) == ("shakespeare", "byte")
        assert link_mbps(r.network) == 80.0 and r.fellows == r.stages


async def test_swarm_job_gives_the_boundarys_bytes_each_way_and_the_ratio(api, auth, capsys):
    """A 2-stage fixed_int8 job of d=16, seq 8, micro-batches of 4: each frame 4*8 rows of
    16 int8 codes and a float32 scale, against none's 4*8*16 float32 values."""
    from swarm_tui.cli import run
    from tests.support import TOKEN

    for i in range(2):
        resp = await api.post("/api/v1/fellows/register", headers=auth, json={
            "name": f"f{i}", "instance_id": f"i{i}", "devices": ["cpu"],
            "data_addrs": [f"127.0.0.1:{9100 + i}"]})
        assert resp.status == 201, await resp.text()
    resp = await api.post("/api/v1/jobs", headers=auth, json={
        "name": "b", "kind": "train",
        "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8,
                  "compression": "fixed_int8"},
        "topology": {"stages": 2}, "training": {"steps": 5, "batch_size": 8,
                                               "micro_batches": 2}})
    assert resp.status == 201, await resp.text()
    job_id = (await resp.json())["job_id"]
    url = str(api.make_url("")).rstrip("/")

    def cli(*argv: str) -> int:
        return run(["--leader-url", url, "--token", TOKEN, *argv])

    frame, plain = 2 * (HEADER_SIZE + 4 * 8 * (16 + 4)), 2 * (HEADER_SIZE + 4 * 8 * 16 * 4)
    assert await asyncio.to_thread(cli, "job", job_id, "--format", "json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["boundary"] == {"act_bytes_per_step": frame, "grad_bytes_per_step": frame,
                                "none_bytes_per_step": 2 * plain,
                                "ratio_to_none": pytest.approx(plain / frame)}
    assert data["job_id"] == job_id and "metrics" in data  # (the job's own fields stay)
    assert await asyncio.to_thread(cli, "job", job_id) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("boundary per step"))
    assert re.search(rf"ACT {frame / 1024:.1f} KiB forward · GRAD {frame / 1024:.1f} KiB "
                     rf"backward · {plain / frame:.1f}x fewer than none", line), line


def _frontier_with(tmp_path: Path, **sweep: Any) -> Path:
    """The frontier figure's config, with ``sweep`` fields over its own, beside copies of its
    profiles."""
    src = Path(__file__).parents[2] / "exp" / "configs"
    for rel in ("model/fig_d256_l8.json", "training/boundary_frontier_cpu.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((src / rel).read_text())
    cfg = json.loads((src / "exp_boundary_frontier_v1.json").read_text())
    cfg["sweep"] |= sweep
    path = tmp_path / "e.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("sweep, needle", [
    ({"stages": [2, 16]}, "$.sweep.stages[1]: 16 stages for 8 layers"),
    ({"stages": [2, 2]}, "$.sweep.stages: must list unique stage counts"),
    ({"compressions": ["subspace_k12_int8_b8"]},
     "$.sweep.compressions[0]: int8 block 8 in 'subspace_k12_int8_b8'"),
    ({"compressions": ["hadamard_int4_b48"]},
     "$.sweep.compressions[0]: hadamard_int4 tile 48 in 'hadamard_int4_b48'"),
])
def test_swarm_validate_refuses_a_shape_the_frontier_cannot_run_in_one_line(
        tmp_path, capsys, sweep, needle):
    from swarm_tui.cli import run

    assert run(["validate", str(_frontier_with(tmp_path, **sweep))]) != 0
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_a_stages_axis_names_each_run_by_its_depth(tmp_path):
    from swarm_core.config.profiles import load_experiment

    runs = load_experiment(_frontier_with(tmp_path, stages=[2, 4], seeds=[0],
                                          compressions=["none"])).runs
    assert [(r.run_name, r.fellows) for r in runs] == [
        ("fig_d256_l8-none-80mbit-2x1-none-s0-r0", 2),
        ("fig_d256_l8-none-80mbit-4x1-none-s0-r0", 4)]


def test_the_report_figure_gives_each_specs_boundary_and_its_loss_by_wall_time(tmp_path):
    """Two specs of the frontier, two seeds each, one 80 Mbit/s network: the figure's table
    has each spec's planned bytes each way, the ratio to none and the codec errors (the
    means over its runs), and the wall-time chart a point per spec at its runs' mean."""
    from swarm_core.experiments.report import (
        BOUNDARY_HEADERS,
        boundary_figures,
        figure_rows,
        load_runs,
        loss_by_bytes_points,
        loss_by_wall_points,
        step_by_link_points,
    )

    specs = {"none": (1_000_000, 1.0, None, None), "subspace_k8_int8": (12_000, 83.3, 0.004, 0.006)}
    dirs = []
    for spec, (each_way, ratio, e_act, e_grad) in specs.items():
        for seed in (0, 1):
            d = tmp_path / f"run-{spec}-s{seed}"
            d.mkdir()
            (d / "train_progress.ndjson").write_text(json.dumps(
                {"step": 1, "loss": 3.0, "wire_bytes": 2 * each_way, "ts": 1.0}) + "\n")
            errors = [{"act": e_act + 0.001 * seed} if e_act is not None else {"act": 0.0},
                      {"grad": e_grad} if e_grad is not None else {"grad": 0.0}]
            (d / "metrics_summary.json").write_text(json.dumps({
                "run_id": d.name, "status": "COMPLETED", "eval_loss": 2.4 + 0.01 * seed,
                "wall_time_s": 100.0 + 10 * seed, "wire_bytes_per_step": 2.0 * each_way,
                "compression": spec, "network_profile": "80mbit", "link_mbps": 80.0,
                "model": "m", "seed": seed, "repeat": 0, "stages": 2, "replicas": 1,
                "sync_mode": "none", "codec_error_by_stage": errors,
                "act_bytes_per_step": each_way, "grad_bytes_per_step": each_way,
                "boundary_ratio": ratio}))
            dirs.append(d)
    runs, skipped = load_runs(dirs)
    assert not skipped
    wall = loss_by_wall_points(runs)
    assert [(p.series, p.x, p.y, p.runs) for p in wall] == [
        (s, 105.0, pytest.approx(2.405), 2) for s in specs]
    headers, rows = figure_rows(loss_by_bytes_points(runs), step_by_link_points(runs),
                                boundary_figures(runs))
    assert headers[-len(BOUNDARY_HEADERS):] == BOUNDARY_HEADERS
    by_series = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    k8 = by_series["subspace_k8_int8"]
    assert (k8["ACT B/step"], k8["GRAD B/step"], k8["none/this"], k8["act error"],
            k8["grad error"]) == ("12,000", "12,000", "83.3", "0.0045", "0.0060")
    assert by_series["none"]["none/this"] == "1.0"
