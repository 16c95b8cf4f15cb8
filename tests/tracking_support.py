"""Reading tracking output back the way the tools themselves read it, to compare with a run's
``train_progress.ndjson``."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
                           ("wire_bytes", "wire/bytes_per_step"), ("eval_loss", "eval/loss"),
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
