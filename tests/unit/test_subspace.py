"""``subspace_kK`` (Subspace Networks, arXiv 2506.01260): a pipeline through 2 and 3 stages
computes the losses of an independent one-process model with the same constraint
(``tests/subspace_reference.py``, plain PyTorch), the residual writers stay in span(U), K
values per token cross each way, and a spec that cannot apply is a one-line error."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import torch

from swarm_core.config.schemas import ModelConfig, TrainingConfig, parse_compression
from swarm_core.contract.placement import split_layers
from swarm_core.data import load_token_data
from swarm_core.pipeline.frames import HEADER_SIZE
from swarm_core.pipeline.local import run_local_pipeline
from swarm_core.pipeline.reference import train_reference
from swarm_core.pipeline.stage import StageResult, StageSpec, expected_wire_bytes
from swarm_core.schema import SchemaError, structure
from tests.subspace_reference import SubspaceGPT, train

MODEL = dict(d_model=32, n_layers=3, n_heads=2, seq_len=16)
K = 8


@pytest.fixture(scope="module")
def data():
    return load_token_data(TrainingConfig(), MODEL["seq_len"])


def reference_losses(data, tc: TrainingConfig, project_grads: bool = True) -> list[float]:
    model = SubspaceGPT(data.vocab_size, MODEL["d_model"], MODEL["n_layers"], MODEL["n_heads"],
                        MODEL["seq_len"], K, tc.seed, project_grads=project_grads)
    return train(model, lambda s: data.batch(s, tc.batch_size, MODEL["seq_len"], tc.seed),
                 tc.steps, tc.micro_batches, tc.lr, tc.min_lr, tc.warmup_steps,
                 tc.weight_decay, (tc.betas[0], tc.betas[1]), tc.grad_clip)


@pytest.fixture(scope="module")
def reference(data):
    tc = TrainingConfig(steps=20, batch_size=8, micro_batches=4, eval_batches=1)
    return tc, reference_losses(data, tc)


@pytest.mark.parametrize("n, schedule", [(2, "1f1b"), (3, "gpipe")])
def test_a_subspace_pipeline_computes_the_independent_constrained_models_losses(
        data, reference, n, schedule):
    tc, ref = reference
    mc = ModelConfig(**MODEL, compression=f"subspace_k{K}")
    got = run_local_pipeline(mc, attrs.evolve(tc, schedule=schedule), data, n)[n - 1].losses
    assert len(got) == 20
    diff = max(abs(a - b) for a, b in zip(ref, got, strict=True))
    assert diff <= 1e-5, f"{n} stages: max |pipeline - reference| = {diff}"
    assert ref[-1] < ref[0] - 0.5, "the model trains"


def test_replicas_of_a_subspace_pipeline_still_compute_the_references_losses(data, reference):
    """Data parallel, 2 stages x 2 replicas: the group's mean of the projected gradients is
    the projected mean (the projection waits for the ring, which may still be sending the
    gradients' buffers), so the replicas' mean loss is the one-process model's."""
    tc, ref = reference
    mc = ModelConfig(**MODEL, compression=f"subspace_k{K}")
    res = run_local_pipeline(mc, tc, data, 2, replicas=2)
    assert all(isinstance(r, StageResult) for r in res.values()), res
    last = [res[r * 2 + 1].losses for r in range(2)]  # (cell r x stages + s)
    got = [(a + b) / 2 for a, b in zip(*last, strict=True)]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


def test_without_the_gradient_projection_the_reference_is_another_model(data, reference):
    """Why the writers' gradients are projected too: the stage before a boundary only learns
    U^T dL/dx, so a one-process model that steps on the whole gradient is not the one the
    pipeline trains."""
    tc, ref = reference
    whole = reference_losses(data, attrs.evolve(tc, steps=8), project_grads=False)
    assert max(abs(a - b) for a, b in zip(ref[:8], whole, strict=True)) > 1e-3


def test_the_residual_writers_stay_in_span_u_and_the_stream_crosses_exactly(data):
    """After steps, every writer W of every stage has (I - UU^T)W = 0 (U as the reference
    draws it) while U^T W does not vanish; x rebuilt from the K coordinates that cross is the
    stream the sender held."""
    mc = ModelConfig(**MODEL, compression=f"subspace_k{K}")
    tc = TrainingConfig(steps=4, batch_size=8, micro_batches=2, eval_batches=0)
    saved: dict[int, dict[str, torch.Tensor]] = {}

    def keep(stage: int):
        def hook(ck: Any) -> None:
            saved[stage] = {k: v.detach().clone() for k, v in ck.module.state_dict().items()}
        return hook

    res = run_local_pipeline(mc, tc, data, 3,
                             stage_kwargs={s: {"on_checkpoint": keep(s)} for s in range(3)})
    assert all(isinstance(res[s], StageResult) for s in range(3)), res
    u = SubspaceGPT(data.vocab_size, MODEL["d_model"], 1, MODEL["n_heads"], MODEL["seq_len"],
                    K, tc.seed).u
    off = torch.eye(MODEL["d_model"]) - u @ u.T
    writers = {name: w for state in saved.values() for name, w in state.items()
               if name.startswith(("embed.", "blocks.")) and (
                   ".attn.proj." in name or ".mlp.2." in name or name.startswith("embed."))}
    assert len(writers) == 2 + 4 * MODEL["n_layers"]
    for name, w in writers.items():
        # (as d-wide rows: a table's rows, a projection's columns, a bias)
        rows = w if name.startswith("embed.") else w.reshape(1, -1) if w.dim() == 1 else w.T
        assert float((rows @ off).norm()) <= 1e-5 * max(1.0, float(rows.norm())), name
        assert float((rows @ u).norm()) > 1e-3, name  # (not trivially zero)

    # The frame's maps: what crosses is K wide and rebuilds the stream.
    from swarm_core.pipeline.model import StageModule

    torch.manual_seed(0)
    first = StageModule(mc, data.vocab_size, tc.seed, 0, 1, 0, 3)
    second = StageModule(mc, data.vocab_size, tc.seed, 1, 2, 1, 3)
    x, _ = data.batch(0, 2, MODEL["seq_len"], tc.seed)
    with torch.no_grad():
        c = first(x)
        assert c.shape == (2, MODEL["seq_len"], K)
        stream = first.frame.enter(first.embed(x), x, True)  # type: ignore[union-attr]
        for block in first.blocks.values():
            stream = block(stream)
        rebuilt = second.frame.enter(c, x, False)  # type: ignore[union-attr]
        assert torch.allclose(rebuilt, stream, atol=1e-6)


@pytest.mark.parametrize("spec, per_elem, scales_per_row", [
    ("subspace_k8", 4, 0), ("subspace_k8_int8", 1, 1), ("subspace_k8_int8_b4", 1, 2),
    ("subspace_k8_fp8", 1, 1), ("subspace_k8_fp8_b2", 1, 4),
])
def test_k_values_per_token_cross_each_way(data, spec, per_elem, scales_per_row):
    """The middle stage of three sends micro-batches of K coordinates forward and their
    gradients back (plus the two norm frames of clipping): counted on its links, planned by
    ``expected_wire_bytes``."""
    mc = ModelConfig(**MODEL, compression=spec)
    tc = TrainingConfig(steps=2, batch_size=8, micro_batches=2, eval_batches=0)
    res = run_local_pipeline(mc, tc, data, 3)
    rows = (8 // 2) * MODEL["seq_len"]
    frame = HEADER_SIZE + rows * K * per_elem + rows * scales_per_row * 4
    norm_frame = HEADER_SIZE + 8
    expected = {0: 2 * frame + norm_frame, 1: 2 * 2 * frame + 2 * norm_frame,
                2: 2 * frame + norm_frame}
    for s, want in expected.items():
        assert res[s].metrics.wire_tx_bytes_per_step == want
        assert res[s].metrics.expected_wire_tx_bytes_per_step == want
        assert expected_wire_bytes(mc, tc, s, 3) == want
    assert res[2].losses[-1] == res[2].losses[-1]  # (it ran: a number, not NaN)


def test_coded_subspace_pipeline_matches_its_one_process_model(data):
    """int8 codes on the coordinates: the project's one-process model codes them alike."""
    mc = ModelConfig(**MODEL, compression="subspace_k8_int8_b4")
    tc = TrainingConfig(steps=4, batch_size=8, micro_batches=2, eval_batches=1)
    ref, _ = train_reference(mc, tc, data, split_layers(mc.n_layers, [1, 1, 1]))
    got = run_local_pipeline(mc, tc, data, 3)[2].losses
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-5


def test_every_stage_reads_the_tokens_under_a_subspace_spec():
    plain = StageSpec("j", "k", 1, 3, (1, 2), None, ModelConfig(**MODEL), TrainingConfig())
    sub = attrs.evolve(plain, model=ModelConfig(**MODEL, compression="subspace_k8"))
    assert (plain.reads_tokens, sub.reads_tokens) == (False, True)


def test_subspace_specs_parse():
    c = parse_compression("subspace_k16_int8_b4", d_model=64)
    assert (c.subspace, c.element, c.block, c.form, c.bottleneck_dim) == (
        16, "int8", 4, "subspace_kK_int8_bB", None)
    assert parse_compression("subspace_k63", d_model=64).subspace == 63


@pytest.mark.parametrize("body, field, needle", [
    ({"compression": "subspace_k32"}, "$.compression",
     "subspace width 32 in 'subspace_k32' must be 1..d_model-1 (32)"),
    ({"compression": "subspace_k40"}, "$.compression", "subspace width 40 in 'subspace_k40'"),
    ({"compression": "subspace_k0"}, "$.compression", "subspace width 0 in 'subspace_k0'"),
    ({"compression": "subspace_k8_int8_b3"}, "$.compression",
     "int8 block 3 in 'subspace_k8_int8_b3' must be 2..65535 and divide the boundary's "
     "width (8)"),
    ({"compression": "subspace_k8", "bottleneck_dim": 8}, "$.compression",
     "'subspace_k8' takes no bottleneck_dim (8)"),
    ({"compression": "subspace_kK"}, "$.compression", "unknown compression 'subspace_kK'"),
    ({"compression": "subspace_k8_int9"}, "$.compression", "unknown compression"),
    ({"compression": "subspace_k8", "dropout": 0.1}, "$.dropout",
     "must be 0 under 'subspace_k8'"),
])
def test_a_subspace_spec_that_cannot_apply_is_a_one_line_error(body, field, needle):
    with pytest.raises(SchemaError) as exc:
        structure({**MODEL, **body}, ModelConfig)
    assert exc.value.field == field
    assert needle in exc.value.message and "\n" not in exc.value.message


def test_swarm_validate_names_the_spec_that_cannot_apply(tmp_path, capsys):
    from swarm_tui.cli import run

    (tmp_path / "model").mkdir()
    (tmp_path / "training").mkdir()
    (tmp_path / "model" / "m.json").write_text(json.dumps({"name": "m", **MODEL}))
    (tmp_path / "training" / "t.json").write_text(json.dumps(
        {"steps": 3, "batch_size": 4, "micro_batches": 2, "cluster_profile": {"fellows": 2}}))
    exp = tmp_path / "e.json"
    exp.write_text(json.dumps({"name": "e", "training_config": "training/t.json",
                               "model_configs": ["model/m.json"],
                               "sweep": {"compressions": ["subspace_k8", "subspace_k32"]}}))
    assert run(["validate", str(exp)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "subspace width 32 in 'subspace_k32'" in err[0], err
    exp.write_text(json.dumps({"name": "e", "training_config": "training/t.json",
                               "model_configs": ["model/m.json"],
                               "sweep": {"compressions": ["subspace_k8", "subspace_k8_int8"]}}))
    assert run(["validate", str(exp)]) == 0


def test_the_launcher_and_submit_offer_and_check_a_subspace_profile(tmp_path, capsys):
    """The shipped ``small_subspace_k16`` profile is among the launcher's models and loads as
    ``swarm submit --model`` loads it; a profile whose spec cannot apply is refused before
    any request, in one line naming the spec."""
    from swarm_core.config.profiles import load_model_profile
    from swarm_tui.app.launch import ProfileSource
    from swarm_tui.cli import run
    from tests.support import REPO

    configs = REPO / "exp" / "configs"
    assert "model/small_subspace_k16.json" in ProfileSource(configs).options("model")
    shipped = load_model_profile(configs / "model" / "small_subspace_k16.json")
    assert shipped.compression_spec.subspace == 16
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", **MODEL, "compression": "subspace_k32_int8"}))
    assert run(["submit", "--model", str(bad), "--leader-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'subspace_k32_int8'" in err[0], err
