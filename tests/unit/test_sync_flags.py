"""``swarm submit``'s sync flags (--sync, --inner-steps, --overlap-steps, --sync-compression,
and SparseLoCo's --density, --chunk, --value-bits, --error-decay): structured once, over the
training profile's sync, into a SyncConfig; a bad value is one usage line that names the flag
it came from. (Submitting them to a leader: test_cli_grid.py.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from swarm_core.config.schemas import SyncConfig
from swarm_tui.cli import run
from swarm_tui.commands.base import CommandError, ExitCode
from swarm_tui.commands.jobs import _sync_config

MODEL = {"name": "m", "d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}


def _flags(**given: object) -> argparse.Namespace:
    values = {"sync": None, "inner_steps": None, "overlap_steps": None, "fragments": None,
              "sync_compression": None, "density": None, "chunk": None, "value_bits": None,
              "error_decay": None, "dct_chunk": None, "topk": None, "sign_values": None,
              "momentum_decay": None}
    return argparse.Namespace(**{**values, **given})


def test_the_flags_are_one_sync_config_over_the_profiles() -> None:
    profile = {"steps": 8, "sync": {"mode": "diloco", "inner_steps": 10, "outer_lr": 0.3}}
    sync = _sync_config(_flags(inner_steps=4, overlap_steps=2, sync_compression="int8"),
                        profile)
    assert sync == SyncConfig(mode="diloco", inner_steps=4, overlap_steps=2,
                              compression="int8", outer_lr=0.3)  # (its outer_lr kept)
    assert _sync_config(_flags(), profile) is None  # no flag: the profile's, untouched
    assert _sync_config(_flags(sync="dp"), {}) == SyncConfig(mode="dp")


def test_fragments_by_flag() -> None:
    assert _sync_config(_flags(sync="diloco", inner_steps=8, fragments=4,
                               sync_compression="int4_b64"), {}) == \
        SyncConfig(mode="diloco", inner_steps=8, fragments=4, compression="int4_b64")


def test_demo_and_its_fields_by_flags() -> None:
    assert _sync_config(_flags(sync="demo", topk=16, sign_values=False), {}) == \
        SyncConfig(mode="demo", topk=16, sign_values=False)
    assert _sync_config(_flags(dct_chunk=32, momentum_decay=0.99), {"sync": {"mode": "demo"}}) \
        == SyncConfig(mode="demo", dct_chunk=32, momentum_decay=0.99)


def test_sparseloco_and_its_fields_by_flags() -> None:
    assert _sync_config(_flags(sync="sparseloco", density=0.05), {}) == \
        SyncConfig(mode="sparseloco", density=0.05)
    sync = _sync_config(_flags(chunk=1024, value_bits=4, error_decay=0.9),
                        {"sync": {"mode": "sparseloco", "inner_steps": 10}})
    assert sync == SyncConfig(mode="sparseloco", inner_steps=10, chunk=1024, value_bits=4,
                              error_decay=0.9)
    assert sync is not None and sync.outer_step == (1.0, 0.0)  # (SparseLoCo's own)
    assert sync.label == "sparseloco H=10 d=0.02 4-bit"
    # A diloco profile's outer fields left out stay the mode's: 0.7 and 0.9 under --sync diloco.
    diloco = _sync_config(_flags(sync="diloco"), {"sync": {"mode": "sparseloco"}})
    assert diloco is not None and diloco.outer_step == (0.7, 0.9)


@pytest.mark.parametrize(("given", "profile", "says"), [
    ({"sync": "sparseloco", "density": 0.0}, {},
     "--density 0.0: $.training.sync.density: must be > 0"),
    ({"density": 1.5}, {}, "--density 1.5: $.training.sync.density: must be <= 1"),
    ({"sync": "sparseloco", "value_bits": 3}, {},
     "--value-bits 3: $.training.sync.value_bits: must be one of 1, 2, 4, 8, 32, got 3"),
    ({"chunk": 0}, {}, "--chunk 0: $.training.sync.chunk: must be > 0"),
    ({"error_decay": -0.1}, {}, "--error-decay -0.1: $.training.sync.error_decay: must be >= 0"),
    ({"sync": "sparseloco", "sync_compression": "int8"}, {},
     "--sync-compression int8: $.training.sync.compression: must be none under sparseloco"),
    # A profile's compression that SparseLoCo cannot take: the flags named.
    ({"sync": "sparseloco"}, {"sync": {"mode": "diloco", "compression": "int8"}},
     "--sync sparseloco over the training profile's sync: $.training.sync.compression: must "
     "be none under sparseloco"),
    ({"sync_compression": "int4"}, {},
     "--sync-compression int4: $.training.sync.compression: unknown sync compression 'int4'"),
    ({"inner_steps": 0}, {}, "--inner-steps 0: $.training.sync.inner_steps: "),
    ({"sync": "diloco", "inner_steps": 4, "overlap_steps": 4}, {},
     "--overlap-steps 4: $.training.sync.overlap_steps: must be below inner_steps (4)"),
    ({"sync": "diloco", "inner_steps": 3, "fragments": 4}, {},
     "--fragments 4: $.training.sync.fragments: must be at most inner_steps (3)"),
    # A field of the profile's that the flags no longer fit: the flags given are named.
    ({"inner_steps": 3}, {"sync": {"mode": "diloco", "inner_steps": 10, "overlap_steps": 5}},
     "--inner-steps 3 over the training profile's sync: $.training.sync.overlap_steps: must "
     "be below inner_steps (3)"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(given: dict[str, object],
                                                profile: dict[str, object], says: str) -> None:
    with pytest.raises(CommandError) as info:
        _sync_config(_flags(**given), profile)
    assert str(info.value).startswith(says) and "\n" not in str(info.value)
    assert info.value.code == ExitCode.USAGE


def test_swarm_submit_says_which_flag_is_wrong_in_one_line_and_submits_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.json"
    model.write_text(json.dumps(MODEL))
    # (no leader at this address: the flags are refused before any is asked)
    code = run(["--leader-url", "http://127.0.0.1:9", "submit", "--model", str(model),
                "--replicas", "2", "--sync", "diloco", "--sync-compression", "int4"])
    assert code == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "swarm: --sync-compression int4: $.training.sync.compression: unknown sync "
        "compression 'int4'")


@pytest.mark.parametrize(("flags", "says"), [
    (["--density", "0"], "swarm: --density 0.0: $.training.sync.density: must be > 0"),
    (["--value-bits", "3"], "swarm: --value-bits 3: $.training.sync.value_bits: must be one of "
     "1, 2, 4, 8, 32, got 3"),
])
def test_swarm_submit_refuses_a_bad_sparseloco_field_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str) -> None:
    model = tmp_path / "m.json"
    model.write_text(json.dumps(MODEL))
    code = run(["--leader-url", "http://127.0.0.1:9", "submit", "--model", str(model),
                "--stages", "1", "--replicas", "2", "--sync", "sparseloco", *flags])
    assert code == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(says)
