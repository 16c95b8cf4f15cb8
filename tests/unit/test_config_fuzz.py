"""Hypothesis on the config loader: any JSON in any file gives a ConfigError or a plan, never
another exception."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm_core.config.profiles import ConfigError, load_experiment
from swarm_core.experiments.suites import load_suite

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=12)


def near(fields: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with the real field names and arbitrary values (most bugs live there)."""
    return st.fixed_dictionaries({}, optional={k: v | json_values for k, v in fields.items()})


model = near({"name": st.text(max_size=10), "d_model": st.integers(-4, 512),
              "n_layers": st.integers(-1, 8), "n_heads": st.integers(-1, 16),
              "seq_len": st.integers(-1, 128), "compression": st.sampled_from(
                  ["none", "fixed_int8", "learned_dim8", "learned_dim0_int8", "zip"])})
training = near({"steps": st.integers(-1, 10), "batch_size": st.integers(-1, 16),
                 "micro_batches": st.integers(-1, 8), "schedule": st.text(max_size=6),
                 "cluster_profile": json_values, "network_profile": json_values,
                 "artifacts": json_values, "export_dir": st.text(max_size=8)})
experiment = near({"name": st.text(max_size=10), "training_config": st.just("t.json"),
                   "model_configs": st.just(["m.json"]) | json_values,
                   "sweep": near({"seeds": json_values, "repeats": st.integers(-1, 3),
                                  "compressions": json_values,
                                  "network_profiles": json_values})})


def _write(d: Path, name: str, data: Any, raw: bool) -> Path:
    p = d / name
    p.write_text(data if raw else json.dumps(data))
    return p


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(exp=experiment | json_values, mdl=model | json_values, trn=training | json_values,
       garbage=st.sampled_from([None, "e.json", "m.json", "t.json"]))
def test_loader_never_crashes(tmp_path_factory, exp, mdl, trn, garbage):
    d = tmp_path_factory.mktemp("cfg")
    _write(d, "m.json", mdl, False)
    _write(d, "t.json", trn, False)
    path = _write(d, "e.json", exp, False)
    if garbage:
        (d / garbage).write_text('{"truncated": ')
    try:
        resolved = load_experiment(path)
    except ConfigError as exc:
        assert str(exc).startswith(str(exc.path))
        return
    assert resolved.runs, "a valid config expands to at least one run"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(suite=near({"name": st.text(max_size=8), "scenarios": json_values,
                   "baseline": json_values, "repeats": json_values}) | json_values)
def test_suite_loader_never_crashes(tmp_path_factory, suite):
    d = tmp_path_factory.mktemp("suite")
    path = _write(d, "s.json", suite, False)
    try:
        load_suite(path)
    except ConfigError:
        return
