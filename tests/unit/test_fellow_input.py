"""What a fellow sends cannot poison the leader or the screens that show it: every limit the
OpenAPI document states is one the leader enforces, a stage's figures are bounded so a job
always stays storable, and a fellow's words reach terminals as text, never as commands."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from swarm_core.contract.metrics import MAX_BYTES
from swarm_core.protocol import SESSION_HEADER
from swarm_core.schema import json_schema
from swarm_core.validators import CONTROL, meta, printable
from swarm_tui.commands.base import emit_table, print_line, warn
from tests.support import AUTH

A = "/api/v1"
MODEL = {"d_model": 16, "n_layers": 3, "n_heads": 2, "seq_len": 8}
HOSTILE = "boom \x1b[31mRED\x1b[0m \x1b]0;owned\x07 [bold red]markup[/] \x00nul \x9bCSI"


async def _register(api, name: str, **extra: Any):
    body = {"name": name, "instance_id": f"{name}-1", "data_addr": "127.0.0.1:9", **extra}
    return await api.post(f"{A}/fellows/register", json=body, headers=AUTH)


@pytest.mark.parametrize("field,value", [
    ("host", "h" * 256), ("host", "h" * 100_000), ("host", "a\nb"),
    ("version", "v" * 100_000), ("data_addr", "a" * 100_000),
])
async def test_register_limits_in_the_document_are_enforced(api, field, value):
    doc = await (await api.get(f"{A}/openapi.json", headers=AUTH)).json()
    prop = doc["components"]["schemas"]["RegisterRequest"]["properties"][field]
    assert len(value) > prop["maxLength"] or CONTROL.search(value)
    resp = await _register(api, "f0", **{field: value})
    assert resp.status == 400
    assert (await resp.json())["error"]["field"] == f"$.{field}"
    listed = await (await api.get(f"{A}/fellows", headers=AUTH)).json()
    assert listed["fellows"] == []
    ok = await _register(api, "f0", host="h" * prop.get("maxLength", 255)
                         if field == "host" else "host")
    assert ok.status == 201, await ok.text()


async def test_heartbeat_job_names_are_bounded(api):
    reg = await (await _register(api, "f0")).json()
    headers = {**AUTH, SESSION_HEADER: reg["session"]}
    resp = await api.post(f"{A}/fellows/{reg['fellow_id']}/heartbeat", headers=headers,
                          json={"status": "busy", "current_job": "j" * 100_000})
    assert resp.status == 400
    assert (await resp.json())["error"]["field"] == "$.current_job"


def test_a_limit_stated_only_in_metadata_does_not_reach_the_document():
    @attrs.define
    class Promise:
        host: str = attrs.field(default="", metadata=meta("hostname", maxLength=255))

    with pytest.raises(TypeError, match=r"Promise\.host: metadata states maxLength=255"):
        json_schema(Promise, {})


@pytest.fixture
async def three_stages(api):
    fellows = []
    for i in range(3):
        reg = await (await _register(api, f"f{i}")).json()
        fellows.append({**reg, "headers": {**AUTH, SESSION_HEADER: reg["session"]}})
    job = await (await api.post(f"{A}/jobs", json={
        "kind": "train", "model": MODEL, "training": {"steps": 3},
        "topology": {"fellows": 3}}, headers=AUTH)).json()
    assert job["state"] == "RUNNING", job
    by_stage = {s["stage"]: next(f for f in fellows if f["fellow_id"] == s["fellow_id"])
                for s in job["placement"]["stages"]}
    return job, by_stage


async def _report(api, job, fellow, **body: Any):
    return await api.post(f"{A}/jobs/{job['job_id']}/status", headers=fellow["headers"],
                          json={"fellow_id": fellow["fellow_id"], **body})


async def test_the_largest_figures_every_stage_may_report_keep_the_job_storable(api,
                                                                                three_stages):
    """Each stage at the byte limit: the step's sum is still an int64, so the job is stored,
    listed and read back (two stages at 2**63-1 once made every GET /jobs a 500)."""
    job, stage = three_stages
    biggest = {"wire_tx_bytes": MAX_BYTES, "sync_tx_bytes": MAX_BYTES,
               "activation_peak_bytes": MAX_BYTES, "step_seconds": 1e300}
    for s in range(3):
        resp = await _report(api, job, stage[s], state="RUNNING", step=1, loss=1.0,
                             metrics=biggest)
        assert resp.status == 200, await resp.text()
    assert (await api.get(f"{A}/jobs", headers=AUTH)).status == 200
    records = (await (await api.get(f"{A}/jobs/{job['job_id']}/progress",
                                    headers=AUTH)).json())["records"]
    assert records[0]["wire_bytes"] == 3 * MAX_BYTES and records[0]["sync_bytes"] == 3 * MAX_BYTES
    assert (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).status == 200


@pytest.mark.parametrize("metrics,field", [
    ({"wire_tx_bytes": MAX_BYTES + 1}, "$.metrics.wire_tx_bytes"),
    ({"sync_tx_bytes": 2**63 - 1}, "$.metrics.sync_tx_bytes"),
    ({"wire_tx_bytes": -5}, "$.metrics.wire_tx_bytes"),
    ({"step_seconds": -1.0}, "$.metrics.step_seconds"),
    ({"wire_tx_bytes": "abc"}, "$.metrics.wire_tx_bytes"),
    ({"shard_dir": "/tmp/\x1b]0;x\x07"}, "$.metrics.shard_dir"),
])
async def test_a_figure_out_of_bounds_is_a_400_that_changes_nothing(api, three_stages, metrics,
                                                                    field):
    job, stage = three_stages
    ok = await _report(api, job, stage[2], state="RUNNING", step=1, loss=2.0,
                       metrics={"wire_tx_bytes": 10})
    assert ok.status == 200
    before = await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    resp = await _report(api, job, stage[2], state="RUNNING", step=2, loss=1.0,
                         metrics=metrics)
    assert resp.status == 400
    assert (await resp.json())["error"]["field"] == field
    after = await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert after == before


async def test_a_fellows_failure_message_is_stored_without_control_characters(api,
                                                                            three_stages):
    job, stage = three_stages
    resp = await _report(api, job, stage[1], state="FAILED", step=1, message=HOSTILE)
    assert resp.status == 200, await resp.text()
    failed = await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert failed["state"] == "FAILED"
    assert "boom" in failed["reason"] and not CONTROL.search(failed["reason"])
    # (markup is text: it is escaped where it is shown, not removed here)
    assert "[bold red]markup[/]" in failed["reason"]


def test_tables_and_lines_show_relayed_text_as_text(capsys):
    emit_table(None, ["job", "note"], [["job-1", HOSTILE]])
    print_line(f"job-1: {HOSTILE}\nsecond line")
    warn(f"swarm: {HOSTILE}")
    out, err = capsys.readouterr()
    for shown in (out, err):
        assert "\x1b" not in shown and "\x07" not in shown and "\x00" not in shown
        assert "\x9b" not in shown
    assert "[bold red]markup[/]" in out.splitlines()[2]  # the table row, brackets kept
    assert out.count("[bold red]markup[/]") == 2 and "\nsecond line\n" in out
    assert "[bold red]markup[/]" in err


def test_printable_keeps_text_and_lines():
    assert printable("a\tb\x1bc") == "a b c"
    assert printable("one\ntwo\x07", keep_newlines=True) == "one\ntwo "
    assert printable("grüße [x]") == "grüße [x]"
