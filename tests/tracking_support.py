"""Reading tracking output back the way the tools themselves read it, to compare with a run's
``train_progress.ndjson``; and a one-run experiment whose two stages a test plays over HTTP
against a real leader, to look at a sweep between its steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarm_core.protocol import SESSION_HEADER
from tests.support import AUTH

A = "/api/v1"


def read_tb(logdir: Path) -> dict[str, Any]:
    """What TensorBoard's server reads of a run folder (its plugin accumulator, which also
    applies purges): {"scalars": {tag: [(step, value)]}, "text": {tag: [(step, str)]},
    "hparams": {name: value}}."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    out: dict[str, Any] = {"scalars": {}, "text": {}, "hparams": {}}
    for tag in acc.Tags()["tensors"]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        if plugin == "scalars":
            out["scalars"][tag] = [(e.step, make_ndarray(e.tensor_proto).item())
                                   for e in acc.Tensors(tag)]
        elif plugin == "text":
            out["text"][tag] = [(e.step, make_ndarray(e.tensor_proto).item().decode())
                                for e in acc.Tensors(tag)]
    try:
        hparams = acc.PluginTagToContent("hparams")
    except KeyError:  # (a run written without its config)
        hparams = {}
    for content in hparams.values():
        info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
        for name, v in info.hparams.items():
            out["hparams"][name] = getattr(v, v.WhichOneof("kind"))
        out["group"] = info.group_name
    return out


def expected_scalars(lines: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every figure of every progress line, by tag (read straight off the ndjson here)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in lines:
        if line["loss"] is not None:
            out.setdefault("train/loss", []).append((line["step"], line["loss"]))
        for field, tag in (("tokens_per_s", "train/tokens_per_s"),
                           ("wire_bytes", "wire/bytes_per_step"),
                           ("sync_bytes", "sync/bytes_per_step"), ("eval_loss", "eval/loss"),
                           ("perplexity", "eval/perplexity"), ("lr", "train/lr"),
                           ("step_seconds", "train/step_seconds")):
            if line.get(field) is not None:
                out.setdefault(tag, []).append((line["step"], line[field]))
        for field, folder in (("wait_seconds", "link_wait_s"),
                              ("activation_peak_bytes", "activation_peak_bytes"),
                              ("stage_seconds", "stage_seconds")):
            for stage, v in (line.get(field) or {}).items():
                out.setdefault(f"{folder}/stage_{stage}", []).append((line["step"], v))
        for stage, errs in (line.get("codec_error") or {}).items():
            for d, v in errs.items():
                out.setdefault(f"codec_error/stage_{stage}_{d}", []).append((line["step"], v))
    return out


def write_config(tmp_path: Path, steps: int = 3) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "tiny.json").write_text(json.dumps(
        {"name": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16,
         "compression": "fixed_int8"}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": steps, "batch_size": 4, "micro_batches": 2,
         "cluster_profile": {"fellows": 2}, "artifacts": {"runs_dir": "../runs"}}))
    cfg = tmp_path / "exp.json"
    cfg.write_text(json.dumps({"name": "tracked", "training_config": "training/t.json",
                               "model_configs": ["model/tiny.json"]}))
    return cfg


async def register_stages(api, n: int) -> list[dict[str, Any]]:
    fellows = []
    for i in range(n):
        body = {"name": f"f{i}", "instance_id": f"i{i}", "data_addr": f"127.0.0.1:{9000 + i}"}
        reg = await (await api.post(f"{A}/fellows/register", json=body, headers=AUTH)).json()
        fellows.append({**reg, "headers": {**AUTH, SESSION_HEADER: reg["session"]}})
    return fellows


async def report_step(api, job_id: str, fellow: dict[str, Any], step: int,
                      **kw: Any) -> None:
    body = {"fellow_id": fellow["fellow_id"], "state": "RUNNING", "step": step, **kw}
    resp = await api.post(f"{A}/jobs/{job_id}/status", json=body, headers=fellow["headers"])
    assert resp.status == 200, await resp.text()


async def play_step(api, job_id: str, stage: dict[int, dict[str, Any]], step: int
                    ) -> None:
    """Both stages' reports of one step, with every figure a real stage sends."""
    await report_step(api, job_id, stage[0], step, metrics={
        "wire_tx_bytes": 40_000_000 + step, "step_seconds": 0.3, "wait_seconds": 0.1 * step,
        "activation_peak_bytes": 5000 + step, "codec_error": {"act": 0.001 * step}})
    await report_step(api, job_id, stage[1], step, loss=5.0 - 0.25 * step,
                      tokens_per_s=1000.0 + step, metrics={
                          "wire_tx_bytes": 20_000_000 + step, "step_seconds": 0.25,
                          "lr": 1e-3, "wait_seconds": 0.05, "activation_peak_bytes": 7000,
                          "codec_error": {"grad": 0.002 * step}})
