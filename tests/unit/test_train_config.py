"""Train-job configs: compression specs, validation at submit (400 naming the field)."""

from __future__ import annotations

import pytest

from swarm_core.config.schemas import ModelConfig, TrainingConfig, parse_compression
from swarm_core.schema import FieldError, SchemaError, structure
from tests.support import AUTH

A = "/api/v1"


@pytest.mark.parametrize("spec, dim, int8, block", [
    ("none", None, False, 0), ("fixed_int8", None, True, 0), ("fixed_int8_b64", None, True, 64),
    ("learned_dim64", 64, False, 0), ("learned_dim256_int8", 256, True, 0),
    ("learned_dim32_int8_b8", 32, True, 8),
])
def test_compression_specs(spec, dim, int8, block):
    c = parse_compression(spec, d_model=256)
    assert (c.bottleneck_dim, c.int8, c.int8_block, c.spec) == (dim, int8, block, spec)


@pytest.mark.parametrize("spec, bottleneck_dim, needle", [
    ("fixed_int8_b48", None, "int8 block 48 in 'fixed_int8_b48' must be 2..65535 and divide "
                             "the boundary's width (128)"),
    ("learned_dim32_int8_b64", None, "divide the boundary's width (32)"),
    ("fixed_int8_b1", None, "must be 2..65535"),
    ("learned_dim32_b8", None, "valid forms"),  # a block without int8 codes
    ("fixed_int8_b9999999", None, "valid forms"),  # no int() of thousands of digits
])
def test_a_block_or_width_that_does_not_fit_is_a_config_error(spec, bottleneck_dim, needle):
    with pytest.raises(SchemaError) as exc:
        structure({"compression": spec, "d_model": 128, "bottleneck_dim": bottleneck_dim},
                  ModelConfig)
    assert needle in exc.value.message
    assert exc.value.field in ("$.compression", "$.bottleneck_dim")


def test_learned_bottleneck_takes_its_width_from_the_profile():
    assert parse_compression("learned_bottleneck", 32).bottleneck_dim == 32
    with pytest.raises(FieldError, match="needs bottleneck_dim"):
        parse_compression("learned_bottleneck")


@pytest.mark.parametrize("spec", ["int8", "learned_dim", "learned_dim0", "learned_dimx_int8",
                                  "fixed_fp4", "learned_dim999"])  # (fixed_int4: test_hadamard)
def test_unknown_specs_name_the_valid_forms(spec):
    with pytest.raises(SchemaError) as exc:
        structure({"compression": spec, "d_model": 128}, ModelConfig)
    assert exc.value.field == "$.compression"
    assert "learned_dimK_int8" in exc.value.message or "1..d_model" in exc.value.message


@pytest.mark.parametrize("body, field, needle", [
    ({"model": {"compression": "zip"}}, "$.model.compression", "valid forms"),
    ({"model": {"d_model": 100, "n_heads": 3}}, "$.model.n_heads", "not divisible"),
    ({"training": {"batch_size": 10, "micro_batches": 4}}, "$.training.micro_batches",
     "not divisible"),
    ({"training": {"schedule": "zigzag"}}, "$.training.schedule", "'gpipe', '1f1b'"),
    ({"training": {"stage_weights": [1, 2, 3]}}, "$.training.stage_weights", "3 weights"),
    ({"training": {"dataset": "textfiles"}}, "$.training.dataset_paths", "needs dataset_paths"),
    ({"training": {"lr": -1}}, "$.training.lr", "must be > 0"),
    ({"training": {"lr": 1e-4}}, "$.training.min_lr",
     "min_lr 0.0003 is above lr 0.0001; the schedule decays from lr to min_lr"),
    ({"model": {"n_layers": 1}, "topology": {"fellows": 4}}, "$.topology",
     "nothing to do"),
    ({"model": {"compression": "learned_dim32", "bottleneck_dim": 64}},
     "$.model.bottleneck_dim", "bottleneck_dim 64 contradicts 'learned_dim32'"),
])
async def test_bad_train_payloads_are_400_and_store_nothing(api, body, field, needle):
    payload = {"kind": "train", "topology": {"fellows": 2}, **body}
    resp = await api.post(f"{A}/jobs", json=payload, headers=AUTH)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["field"] == field and needle in err["message"]
    jobs = await (await api.get(f"{A}/jobs", headers=AUTH)).json()
    assert jobs["jobs"] == []


def test_a_stored_config_from_before_the_width_rule_still_loads():
    """Jobs and exports written when a learned_dimK spec silently won over bottleneck_dim
    still load (eval, glue, a resumed sweep): the rule is checked where configs come in."""
    m = structure({"compression": "learned_dim32", "bottleneck_dim": 64, "d_model": 128},
                  ModelConfig)
    assert m.compression_spec.bottleneck_dim == 32



def test_a_stored_config_from_before_the_min_lr_rule_still_loads():
    """A job or export whose lr was set below the default min_lr (the rate rose all run)
    still loads for eval, glue and a fellow's START: the rule is checked where configs come
    in."""
    t = structure({"lr": 1e-4}, TrainingConfig)
    assert (t.lr, t.min_lr) == (1e-4, 3e-4)


def test_the_shipped_model_profiles_load_and_grow_in_size():
    """The four profiles the engine ships (small, small int8, large int8, xlarge bottleneck)
    load through the config loader, each the compression its name says, and grow in size in
    that order (sized on torch's meta device: nothing is allocated)."""
    import torch

    from swarm_core.config.profiles import load_model_profile
    from swarm_core.pipeline.whole import ExperimentModel
    from tests.support import REPO

    names = ["small_none", "small_fixed_int8", "large_fixed_int8", "xlarge_learned_bottleneck"]
    folder = REPO / "exp" / "configs" / "model"
    assert set(names) <= {p.stem for p in folder.glob("*.json")}
    sizes = []
    for name in names:
        mc = load_model_profile(folder / f"{name}.json")
        assert mc.compression == name.split("_", 1)[1]
        with torch.device("meta"):
            model = ExperimentModel(mc, 256, 0, [(0, mc.n_layers // 2),
                                                 (mc.n_layers // 2, mc.n_layers)])
        sizes.append(sum(p.numel() for p in model.parameters()))
    assert sizes[0] == sizes[1] < sizes[2] < sizes[3]
