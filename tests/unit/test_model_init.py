"""The model starts as GPT-2 does (the recipe published baselines assume), each part under its
own seed; ``init: torch`` keeps PyTorch's defaults, and exports say which they were trained
from (one written before the field reads as ``torch``)."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import sys

import pytest
import torch
from torch import nn

from swarm_core.artifacts.glue import glue, load_full_model
from swarm_core.artifacts.manifests import shard_manifest
from swarm_core.config.schemas import ModelConfig
from swarm_core.pipeline.model import StageModule
from swarm_core.pipeline.whole import ExperimentModel
from tests.support import REPO, export

# Wide enough that a tensor's sample std sits within a few per cent of the draw's.
MODEL = {"name": "m", "d_model": 256, "n_layers": 6, "n_heads": 4, "seq_len": 64,
         "compression": "learned_dim64"}
VOCAB = 256


def _std(t: torch.Tensor) -> float:
    return float(t.detach().double().std())


def _parts(init: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig(**MODEL, init=init)
    model = ExperimentModel(cfg, VOCAB, seed=3, ranges=[(0, 3), (3, 6)])
    return cfg, dict(model.flat_state_dict())


def test_gpt2_init_draws_every_part_from_the_recipe():
    cfg, weights = _parts("gpt2")
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)
    seen = set()
    for name, w in weights.items():
        if name.endswith((".attn.proj.weight", ".mlp.2.weight")):
            assert _std(w) == pytest.approx(residual, rel=0.05), name
            seen.add("residual")
        elif name.endswith(".bias") and ".ln" not in name and ".norm" not in name:
            assert torch.count_nonzero(w) == 0, name
            seen.add("bias")
        elif ".ln" in name or ".norm" in name:  # LayerNorms: ones and zeros
            assert torch.equal(w, torch.ones_like(w) if name.endswith("weight")
                               else torch.zeros_like(w)), name
        else:  # every other matrix: QKV, MLP in, head, bottleneck halves, embeddings
            assert w.dim() == 2, name
            assert _std(w) == pytest.approx(0.02, rel=0.05), name
            assert abs(float(w.double().mean())) < 0.002, name
            seen.add(name.split(".")[0])
    assert {"residual", "bias", "embed", "blocks", "head", "down", "up"} <= seen


def test_torch_init_keeps_pytorchs_linear_defaults():
    _cfg, weights = _parts("torch")
    qkv = weights["blocks.0.attn.qkv.weight"]
    # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std 1/sqrt(3 fan_in)
    assert _std(qkv) == pytest.approx(1 / math.sqrt(3 * 256), rel=0.05)
    assert float(qkv.abs().max()) <= 1 / math.sqrt(256)
    assert torch.count_nonzero(weights["blocks.0.attn.qkv.bias"]) > 0
    assert _std(weights["embed.tok.weight"]) == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("init", ["gpt2", "torch"])
def test_a_stage_builds_the_weights_the_whole_model_holds(init):
    """Per-part seeds: a stage built alone starts with exactly the whole model's weights."""
    cfg, whole = _parts(init)
    second = StageModule(cfg, VOCAB, 3, 3, 6, stage=1, num_stages=2)
    own = dict(second.state_dict())
    assert own and all(torch.equal(w, whole[k]) for k, w in own.items())


def test_the_independent_reference_draws_the_same_distributions():
    """bench/reference_gpt.py, written apart from the model, starts from the same
    distributions part by part (a different draw: its own seed and layout)."""
    spec = importlib.util.spec_from_file_location("reference_gpt",
                                                  REPO / "bench" / "reference_gpt.py")
    assert spec is not None and spec.loader is not None
    ref_mod = importlib.util.module_from_spec(spec)
    sys.modules["reference_gpt"] = ref_mod
    try:
        spec.loader.exec_module(ref_mod)
    finally:
        del sys.modules["reference_gpt"]
    tree = ast.parse((REPO / "bench" / "reference_gpt.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith("swarm_core.pipeline") for m in imported), imported
    ref = ref_mod.GPT(VOCAB, 256, 6, 4, 64, 4)
    _cfg, ours = _parts("gpt2")
    pairs = {"wte.weight": "embed.tok.weight",
             "h.0.attn.c_attn.weight": "blocks.0.attn.qkv.weight",
             "h.0.attn.c_proj.weight": "blocks.0.attn.proj.weight",
             "h.0.c_fc.weight": "blocks.0.mlp.0.weight",
             "h.5.c_proj.weight": "blocks.5.mlp.2.weight",
             "lm_head.weight": "head.lm_head.weight"}
    theirs = dict(ref.named_parameters())
    for a, b in pairs.items():
        assert theirs[a].shape == ours[b].shape, (a, b)
        assert _std(theirs[a]) == pytest.approx(_std(ours[b]), rel=0.08), (a, b)
    # Same parameter count: the same architecture, written twice.
    assert sum(p.numel() for p in ref.parameters()) == sum(
        w.numel() for k, w in ours.items() if not k.startswith(("down.", "up.")))


def test_exports_record_their_init_and_an_old_one_still_glues(tmp_path):
    new = export(tmp_path / "new", model={**MODEL, "compression": "none", "init": "gpt2"},
                 ranges=[(0, 3), (3, 6)], vocab=VOCAB)
    m, cfg = shard_manifest(json.loads(
        (new / "shards" / "stage-0-fellow-0" / "shard_manifest.json").read_text()))
    assert m.model["init"] == "gpt2" and cfg.init == "gpt2"
    # Written before the field: no "init" in its model; trained under torch's defaults.
    old_model = {**MODEL, "compression": "none", "init": "torch"}
    old = export(tmp_path / "old", model=old_model, ranges=[(0, 3), (3, 6)], vocab=VOCAB)
    for path in (old / "shards").glob("*/shard_manifest.json"):
        data = json.loads(path.read_text())
        del data["model"]["init"]
        path.write_text(json.dumps(data))
    _m, old_cfg = shard_manifest(json.loads(next((old / "shards").glob(
        "*/shard_manifest.json")).read_text()))
    assert old_cfg.init == "torch"
    model, _manifest = load_full_model(glue(old))
    reference = ExperimentModel(ModelConfig(**old_model), VOCAB, 0, [(0, 3), (3, 6)])
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x), reference.eval()(x))


def test_a_linear_added_to_a_block_is_initialised_too():
    """The init walks the part's modules, so it does not silently miss a new layer."""
    from swarm_core.pipeline.model import gpt2_init

    cfg = ModelConfig(**MODEL)
    part = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    gpt2_init(part, cfg, residual=(part[2],))
    assert _std(part[0].weight) == pytest.approx(0.02, rel=0.05)
    assert _std(part[2].weight) == pytest.approx(0.02 / math.sqrt(12), rel=0.05)
    assert torch.count_nonzero(part[0].bias) == 0
