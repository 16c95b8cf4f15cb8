"""Every route of the leader's HTTP API (swarm_core/leader/routes.py ROUTES), happy paths and
each error status, against a real leader app on a loopback TestServer."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import re
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import WSServerHandshakeError
from aiohttp.test_utils import TestClient

from swarm_core.leader import LeaderConfig, create_app
from swarm_core.leader.keys import STATE_KEY
from swarm_core.leader.routes import ROUTES
from swarm_core.protocol import SESSION_HEADER
from tests.api_support import (
    JSON,
    A,
    beating,
    collect_until,
    expect_error,
    expect_ok,
    get_fellow,
    get_job,
    grid_job,
    heartbeat,
    next_event,
    poll,
    raw,
    register,
    replicated_job,
    report,
    submit,
    wait_for,
    wait_until_failed,
)
from tests.support import AUTH, TOKEN


@pytest.fixture
async def make_api(aiohttp_client, tmp_path: Path):
    """A leader with its own config: ``await make_api(stale_after_s=0.3)``."""
    made = itertools.count()

    async def make(**kw: Any) -> TestClient:
        cfg = LeaderConfig(state_dir=tmp_path / f"state-{next(made)}", token=TOKEN,
                           **{"tick_s": 0.05, **kw})
        return await aiohttp_client(create_app(cfg))

    return make


@pytest.fixture
async def fast_api(make_api) -> TestClient:
    """Fellows go stale 0.3 s after their last heartbeat."""
    return await make_api(stale_after_s=0.3, tick_s=0.05)


# --- meta routes --------------------------------------------------------------------------------


async def test_healthz_without_token(api):
    body = await expect_ok(await api.get("/healthz"))
    assert body["ok"] is True
    assert isinstance(body["version"], str)


async def test_info_counts_and_auth(api):
    await expect_error(await api.get(f"{A}/info"), 401, "unauthorized")
    await expect_error(await api.get(f"{A}/info", headers={"Authorization": "Bearer nope"}),
                       401, "unauthorized")
    await expect_error(await api.get(f"{A}/info", headers={"Authorization": TOKEN}), 401)
    info = await expect_ok(await api.get(f"{A}/info", headers=AUTH))
    assert info["fellows_total"] == 0 and info["jobs_pending"] == 0
    assert info["stale_after_s"] == 5.0 and info["heartbeat_interval_s"] == 1.0
    await register(api, "a")
    await submit(api, fellows=2)
    info = await expect_ok(await api.get(f"{A}/info", headers=AUTH))
    assert (info["fellows_total"], info["fellows_ready"]) == (1, 1)
    assert (info["jobs_pending"], info["jobs_running"]) == (1, 0)


async def test_openapi_lists_every_route(api):
    await expect_error(await api.get(f"{A}/openapi.json"), 401)
    doc = await expect_ok(await api.get(f"{A}/openapi.json", headers=AUTH))
    assert doc["openapi"].startswith("3.")
    for r in ROUTES:
        assert r.path in doc["paths"], r.path
        op = doc["paths"][r.path][r.method.lower()]
        assert op["operationId"] == r.handler.__name__
        for status in r.errors:
            assert str(status) in op["responses"]
        if r.body is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
    assert len({(r.method, r.path) for r in ROUTES}) == sum(
        len(ops) for ops in doc["paths"].values())


def test_each_status_a_handler_raises_is_documented():
    """A status a handler raises itself must be in its route's documented errors: schemathesis
    finds an undocumented one only when its fuzzing happens to reach it (a stale fellow's
    release did, once, in CI)."""
    for r in ROUTES:
        raised = {int(c) for c in re.findall(r"ApiError\(\s*(\d{3})",
                                             inspect.getsource(r.handler))}
        assert raised <= set(r.errors), (r.method, r.path, sorted(raised - set(r.errors)))


async def test_unknown_route_and_method(api):
    await expect_error(await api.get(f"{A}/nope", headers=AUTH), 404, "not_found")
    await expect_error(await api.get("/nope", headers=AUTH), 404, "not_found")
    # Unknown routes still want the token: nothing is learned without it.
    await expect_error(await api.get(f"{A}/nope"), 401)
    await expect_error(await api.delete(f"{A}/jobs", headers=AUTH), 405, "method_not_allowed")


# --- register -----------------------------------------------------------------------------------


async def test_register_returns_id_and_session(api):
    a = await register(api, "alpha", host="h1", pid=42, devices=["cpu", "cuda:0"], threads=4,
                       data_addr="127.0.0.1:9000", version="0.1")
    b = await register(api, "beta")
    assert a["fellow_id"] != b["fellow_id"]
    assert isinstance(a["session"], str) and len(a["session"]) >= 16
    assert a["heartbeat_interval_s"] == 1.0 and a["stale_after_s"] == 5.0
    view = await get_fellow(api, a["fellow_id"])
    assert view["name"] == "alpha" and view["host"] == "h1" and view["pid"] == 42
    assert view["devices"] == ["cpu", "cuda:0"] and view["threads"] == 4
    assert view["data_addr"] == "127.0.0.1:9000" and view["status"] == "ready"


async def test_register_same_name_same_instance_keeps_id(api):
    first = await register(api, "alpha", instance_id="i1")
    await register(api, "other")
    again = await register(api, "alpha", instance_id="i1")
    assert again["fellow_id"] == first["fellow_id"]
    assert again["session"] != first["session"]
    # The old session is gone: only the newest process of a fellow can speak for it.
    resp = await api.post(f"{A}/fellows/{first['fellow_id']}/heartbeat", json={},
                          headers=first["headers"])
    await expect_error(resp, 401, "unknown_session")
    await heartbeat(api, again)
    listed = await expect_ok(await api.get(f"{A}/fellows", headers=AUTH))
    assert [f["name"] for f in listed["fellows"]] == ["alpha", "other"]


async def test_register_name_held_by_live_fellow_409(api):
    await register(api, "alpha", instance_id="i1")
    resp = await api.post(f"{A}/fellows/register", json={"name": "alpha", "instance_id": "i2"},
                          headers=AUTH)
    err = await expect_error(resp, 409, "name_in_use", "$.name")
    assert "alpha" in err["message"]


async def test_register_reuses_id_after_stale(make_api):
    # (1 s, not fast_api's 0.3 s: on a loaded machine the new process went stale again
    # between its registration and the read that checks it)
    api = await make_api(stale_after_s=1.0, tick_s=0.05)
    old = await register(api, "alpha", instance_id="i1")
    await api.post(f"{A}/fellows/{old['fellow_id']}/speed", json={"tx_mbps": 5}, headers=AUTH)
    await wait_for(lambda: _status_is(api, old["fellow_id"], "stale"))
    new = await register(api, "alpha", instance_id="i2")
    assert new["fellow_id"] == old["fellow_id"]
    view = await get_fellow(api, new["fellow_id"])
    assert view["status"] == "ready"
    # A new process starts with a clean signal queue.
    assert await poll(api, new) == []


async def test_register_reuses_id_after_leaving(api):
    old = await register(api, "alpha", instance_id="i1")
    await heartbeat(api, old, status="leaving")
    assert (await get_fellow(api, old["fellow_id"]))["status"] == "leaving"
    new = await register(api, "alpha", instance_id="i2")
    assert new["fellow_id"] == old["fellow_id"]
    assert (await get_fellow(api, new["fellow_id"]))["status"] == "ready"


async def _status_is(api: TestClient, fellow_id: int, status: str) -> bool:
    return (await get_fellow(api, fellow_id))["status"] == status


@pytest.mark.parametrize(("body", "field", "needle"), [
    ({"name": "a", "instance_id": "i", "pid": "12"}, "$.pid", "integer"),
    ({"name": "a", "instance_id": "i", "pid": True}, "$.pid", "integer"),
    ({"name": "a", "instance_id": "i", "pid": -1}, "$.pid", ">= 0"),
    ({"name": 5, "instance_id": "i"}, "$.name", "string"),
    ({"name": "", "instance_id": "i"}, "$.name", "control characters"),
    ({"name": "x" * 129, "instance_id": "i"}, "$.name", "control characters"),
    ({"name": "a\nb", "instance_id": "i"}, "$.name", "control characters"),
    ({"instance_id": "i"}, "$.name", "required"),
    ({"name": "a"}, "$.instance_id", "required"),
    ({"name": "a", "instance_id": "i", "threads": 0}, "$.threads", "between"),
    ({"name": "a", "instance_id": "i", "devices": []}, "$.devices", "1-64"),
    ({"name": "a", "instance_id": "i", "devices": ["tpu"]}, "$.devices", "cuda"),
    ({"name": "a", "instance_id": "i", "devices": ["cpu", 3]}, "$.devices[1]", "string"),
    ({"name": "a", "instance_id": "i", "devices": "cpu"}, "$.devices", "list"),
    ({"name": "a", "instance_id": "i", "data_addr": 1}, "$.data_addr", "string"),
    ({"name": "a", "instance_id": "i", "data_addr": "0.0.0.0:9000"}, "$.data_addr",
     "bind-all address that neighbours cannot dial"),
    ({"name": "a", "instance_id": "i", "data_addr": "127.0.0.1"}, "$.data_addr",
     "is not host:port"),
    ({"name": "a", "instance_id": "i", "data_addrs": ["127.0.0.1:1", "[::]:2"]},
     "$.data_addrs[1]", "bind-all"),
    ({"name": "a", "instance_id": "i", "data_addrs": ["h:70000"]}, "$.data_addrs[0]",
     "not host:port"),
    ({"name": "a", "instance_id": "i", "data_addr": "0:9000"}, "$.data_addr", "bind-all"),
    ({"name": "a", "instance_id": "i", "data_addr": "[::0]:1"}, "$.data_addr", "bind-all"),
    ({"name": "a", "instance_id": "i", "data_addr": "h:\u0663"}, "$.data_addr",
     "not host:port"),  # an Arabic-Indic digit three: not a port
    ({"name": "a", "instance_id": "i", "color": "red"}, "$", "color"),
    ([], "$", "object"),
    ("name", "$", "object"),
])
async def test_register_bad_body_400(api, body, field, needle):
    resp = await api.post(f"{A}/fellows/register", json=body, headers=AUTH)
    err = await expect_error(resp, 400, "invalid_body", field)
    assert needle in err["message"]
    listed = await expect_ok(await api.get(f"{A}/fellows", headers=AUTH))
    assert listed["fellows"] == []


async def test_register_invalid_json_400(api):
    for body in (b"{", b"{'name': 1}", b"\xff\xfe", b"[1,]", b"NaN"):
        resp = await api.post(f"{A}/fellows/register", **raw(body))
        err = await expect_error(resp, 400, "invalid_json")
        assert "not valid JSON" in err["message"]


async def _post_raw(api: TestClient, encoding: str, body: bytes) -> tuple[bytes, bytes]:
    """POST a job body byte for byte with this Content-Encoding (aiohttp's client would not
    send a body its header lies about); the reply's head and payload."""
    reader, writer = await asyncio.open_connection(api.server.host, api.server.port)
    writer.write(b"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Authorization: " + AUTH["Authorization"].encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Encoding: " + encoding.encode()
                 + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    return head, payload


def _gzip_cut_short() -> bytes:
    import gzip
    return gzip.compress(b'{"name": "a"}', mtime=0)[:-6]  # (mtime: ids equal on every worker)


def _gzip_then_junk() -> bytes:
    import gzip
    return gzip.compress(b'{"name": "a"}', mtime=0) + b"junk"


@pytest.mark.parametrize(("encoding", "body"), [
    ("gzip", _gzip_cut_short()), ("gzip", _gzip_then_junk()),
], ids=["cut_short", "trailed"])
async def test_a_gzip_body_cut_short_or_trailed_is_a_400(api, encoding, body):
    head, payload = await _post_raw(api, encoding, body)
    assert head.startswith(b"HTTP/1.1 400"), head
    err = orjson.loads(payload)["error"]
    assert err["code"] == "invalid_body" and "not valid gzip" in err["message"]


@pytest.mark.parametrize(("encoding", "status", "code"), [
    ("gzip", 400, "invalid_body"), ("deflate", 400, "invalid_body"),
    # Codings aiohttp's parser cannot decode here answered its plain-text 400 (and logged a
    # traceback) before any middleware ran: the API decodes bodies itself now.
    ("br", 415, "unsupported_media_type"), ("zstd", 415, "unsupported_media_type"),
    ("x-bogus", 415, "unsupported_media_type"),
])
async def test_a_body_that_does_not_decode_is_an_error_object(api, encoding, status, code,
                                                              caplog):
    head, payload = await _post_raw(api, encoding, b"not compressed at all")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), head
    err = orjson.loads(payload)["error"]
    assert err["code"] == code and encoding in err["message"]
    assert "\n" not in err["message"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    jobs = await (await api.get(f"{A}/jobs", headers=AUTH)).json()
    assert jobs["jobs"] == []


@pytest.mark.parametrize("encoding", ["gzip", "gzip-members", "deflate", "raw-deflate",
                                      "identity"])
async def test_a_compressed_body_is_read(api, encoding):
    import gzip
    import zlib

    body = {"name": "a", "instance_id": "i"}
    data = orjson.dumps(body)
    if encoding == "gzip":
        data = gzip.compress(data)
    elif encoding == "gzip-members":  # two members end to end (RFC 1952)
        data = gzip.compress(data[:10]) + gzip.compress(data[10:])
        encoding = "gzip"
    elif encoding == "deflate":
        data = zlib.compress(data)
    elif encoding == "raw-deflate":  # what some clients send as deflate
        c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        data = c.compress(data) + c.flush()
        encoding = "deflate"
    resp = await api.post(f"{A}/fellows/register", data=data,
                          headers={**JSON, "Content-Encoding": encoding})
    reg = await expect_ok(resp, 201)
    listed = await expect_ok(await api.get(f"{A}/fellows", headers=AUTH))
    assert [f["fellow_id"] for f in listed["fellows"]] == [reg["fellow_id"]]


async def test_a_compressed_body_is_held_to_the_limit_once_decoded(make_api):
    """A few KiB of gzip that would unpack into a body far over the limit: 413, nothing made."""
    import gzip

    api = await make_api(max_json_bytes=4096)
    body = orjson.dumps({"name": "a", "instance_id": "i", "version": "v" * 100_000})
    packed = gzip.compress(body)
    assert len(packed) < 4096 < len(body)
    resp = await api.post(f"{A}/fellows/register", data=packed,
                          headers={**JSON, "Content-Encoding": "gzip"})
    err = await expect_error(resp, 413, "body_too_large")
    assert "4096" in err["message"] and "decoded" in err["message"]
    listed = await expect_ok(await api.get(f"{A}/fellows", headers=AUTH))
    assert listed["fellows"] == []


async def test_register_auth_and_media_type(api):
    body = {"name": "a", "instance_id": "i"}
    await expect_error(await api.post(f"{A}/fellows/register", json=body), 401, "unauthorized")
    await expect_error(await api.post(f"{A}/fellows/register", json=body,
                                      headers={"Authorization": "Bearer wrong"}), 401)
    resp = await api.post(f"{A}/fellows/register", **raw(orjson.dumps(body), "text/plain"))
    await expect_error(resp, 415, "unsupported_media_type")
    # A charset parameter or a missing content type is fine.
    resp = await api.post(f"{A}/fellows/register",
                          **raw(orjson.dumps(body), "application/json; charset=utf-8"))
    await expect_ok(resp, 201)
    resp = await api.post(f"{A}/fellows/register", data=orjson.dumps(body), headers=AUTH)
    await expect_ok(resp, 201)


async def test_register_body_over_default_limit_413(api):
    big = {"name": "a", "instance_id": "i", "version": "v" * (1 << 20)}
    resp = await api.post(f"{A}/fellows/register", **raw(orjson.dumps(big)))
    err = await expect_error(resp, 413, "body_too_large")
    assert str(1 << 20) in err["message"]


async def test_body_over_configured_limit_413(make_api):
    api = await make_api(max_json_bytes=2048)
    ok = {"name": "a", "instance_id": "i", "host": "h" * 255, "version": "v" * 64}
    await expect_ok(await api.post(f"{A}/fellows/register", json=ok, headers=AUTH), 201)
    big = {**ok, "version": "v" * 4000}
    await expect_error(await api.post(f"{A}/fellows/register", json=big, headers=AUTH),
                       413, "body_too_large")
    job = {"model": {"blob": "x" * 4000}}
    await expect_error(await api.post(f"{A}/jobs", json=job, headers=AUTH), 413)
    jobs = await expect_ok(await api.get(f"{A}/jobs", headers=AUTH))
    assert jobs["jobs"] == []


# --- fellows: list, get -------------------------------------------------------------------------


async def test_list_and_get_fellows(api):
    assert (await expect_ok(await api.get(f"{A}/fellows", headers=AUTH)))["fellows"] == []
    await expect_error(await api.get(f"{A}/fellows"), 401)
    a = await register(api, "a")
    b = await register(api, "b")
    listed = await expect_ok(await api.get(f"{A}/fellows", headers=AUTH))
    assert [f["fellow_id"] for f in listed["fellows"]] == [a["fellow_id"], b["fellow_id"]]
    one = await get_fellow(api, b["fellow_id"])
    assert one == {**listed["fellows"][1], "heartbeat_age_s": one["heartbeat_age_s"]}


@pytest.mark.parametrize(("path_id", "status", "code"), [
    ("99", 404, "unknown_fellow"),
    # Ids are digits in the route itself: anything else names no resource.
    ("abc", 404, "not_found"),
    ("-1", 404, "not_found"),
    ("1.5", 404, "not_found"),
    ("99999999999999999999", 400, "invalid_param"),
])
async def test_get_fellow_errors(api, path_id, status, code):
    await register(api, "a")
    resp = await api.get(f"{A}/fellows/{path_id}", headers=AUTH)
    err = await expect_error(resp, status, code)
    if status == 400:
        assert err["field"] == "fellow_id"


# --- heartbeat ----------------------------------------------------------------------------------


async def test_heartbeat_updates_view(api):
    f = await register(api, "a")
    reply = await heartbeat(api, f, status="busy", current_job="job-x", current_stage=1,
                            current_step=17, last_loss=2.5, tokens_per_s=123.0,
                            counters={"control_tx": 10, "control_rx": 20, "data_tx": 30,
                                      "data_rx": 40},
                            link={"tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 25})
    assert reply == {"pending_signals": 0, "send_log": False}
    view = await get_fellow(api, f["fellow_id"])
    assert view["status"] == "busy" and view["reported_status"] == "busy"
    assert view["current_job"] == "job-x" and view["current_stage"] == 1
    assert view["current_step"] == 17 and view["last_loss"] == 2.5
    assert view["tokens_per_s"] == 123.0
    assert view["counters"] == {"control_tx": 10, "control_rx": 20, "data_tx": 30, "data_rx": 40}
    assert view["link"] == {"tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 25.0}
    assert view["last_heartbeat"] is not None and 0 <= view["heartbeat_age_s"] < 1
    # An empty body is a plain "ready" heartbeat with defaults.
    await heartbeat(api, f)
    view = await get_fellow(api, f["fellow_id"])
    assert view["status"] == "ready" and view["current_step"] == 0


async def test_heartbeat_acknowledges_signals(api):
    f = await register(api, "a")
    for mbps in (1, 2, 3):
        await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json={"tx_mbps": mbps},
                       headers=AUTH)
    assert (await heartbeat(api, f, signal_seq=2)) == {"pending_signals": 1, "send_log": False}
    assert [s["seq"] for s in await poll(api, f)] == [3]
    assert (await heartbeat(api, f, signal_seq=3)) == {"pending_signals": 0, "send_log": False}


@pytest.mark.parametrize(("body", "field"), [
    ({"link": {"tx_mbps": -1}}, "$.link.tx_mbps"),
    ({"link": {"tx_mbps": 0}}, "$.link.tx_mbps"),
    ({"link": {"latency_ms": 60001}}, "$.link.latency_ms"),
    ({"link": {"rx_mbps": "fast"}}, "$.link.rx_mbps"),
    ({"link": {"jitter": 1}}, "$.link"),
    ({"link": []}, "$.link"),
    ({"counters": {"control_tx": -5}}, "$.counters.control_tx"),
    ({"counters": {"data_rx": 1.5}}, "$.counters.data_rx"),
    ({"counters": 7}, "$.counters"),
    ({"status": "asleep"}, "$.status"),
    ({"status": "stale"}, "$.status"),
    ({"current_step": -1}, "$.current_step"),
    ({"current_step": False}, "$.current_step"),
    ({"tokens_per_s": -0.5}, "$.tokens_per_s"),
    ({"signal_seq": "1"}, "$.signal_seq"),
    ({"bogus": 1}, "$"),
])
async def test_heartbeat_bad_body_400(api, body, field):
    f = await register(api, "a")
    resp = await api.post(f"{A}/fellows/{f['fellow_id']}/heartbeat", json=body,
                          headers=f["headers"])
    await expect_error(resp, 400, "invalid_body", field)
    assert (await get_fellow(api, f["fellow_id"]))["link"]["tx_mbps"] is None


async def test_heartbeat_nested_non_object_says_so(api):
    f = await register(api, "a")
    for body, field in (({"counters": [1, 2]}, "$.counters"), ({"link": None}, "$.link")):
        resp = await api.post(f"{A}/fellows/{f['fellow_id']}/heartbeat", json=body,
                              headers=f["headers"])
        err = await expect_error(resp, 400, "invalid_body", field)
        assert err["message"].startswith("expected an object, got ")


async def test_heartbeat_invalid_json_400(api):
    f = await register(api, "a")
    resp = await api.post(f"{A}/fellows/{f['fellow_id']}/heartbeat", data=b"{nope",
                          headers={**f["headers"], "Content-Type": "application/json"})
    await expect_error(resp, 400, "invalid_json")
    resp = await api.post(f"{A}/fellows/x/heartbeat", json={}, headers=f["headers"])
    await expect_error(resp, 404, "not_found")


async def test_heartbeat_auth_401_403(api):
    a = await register(api, "a")
    b = await register(api, "b")
    url = f"{A}/fellows/{a['fellow_id']}/heartbeat"
    await expect_error(await api.post(url, json={}), 401, "unauthorized")
    await expect_error(await api.post(url, json={}, headers={
        "Authorization": "Bearer wrong", SESSION_HEADER: a["session"]}), 401, "unauthorized")
    await expect_error(await api.post(url, json={}, headers=AUTH), 401, "unknown_session")
    await expect_error(await api.post(url, json={}, headers={**AUTH, SESSION_HEADER: "bogus"}),
                       401, "unknown_session")
    err = await expect_error(await api.post(url, json={"status": "busy"}, headers=b["headers"]),
                             403, "wrong_fellow")
    assert str(b["fellow_id"]) in err["message"]
    # Nothing changed for either fellow.
    assert (await get_fellow(api, a["fellow_id"]))["status"] == "ready"
    assert (await get_fellow(api, b["fellow_id"]))["status"] == "ready"
    # A session on an unknown fellow id is another fellow's id: 403 too.
    await expect_error(await api.post(f"{A}/fellows/99/heartbeat", json={}, headers=a["headers"]),
                       403, "wrong_fellow")


async def test_heartbeat_released_ends_session(api):
    f = await register(api, "a")
    await heartbeat(api, f, status="released")
    assert (await get_fellow(api, f["fellow_id"]))["status"] == "released"
    resp = await api.post(f"{A}/fellows/{f['fellow_id']}/heartbeat", json={},
                          headers=f["headers"])
    await expect_error(resp, 401, "unknown_session")


# --- signals ------------------------------------------------------------------------------------


async def test_signals_all_kinds_with_increasing_seq_and_after(api):
    f = await register(api, "a", data_addr="127.0.0.1:7000")
    fid = f["fellow_id"]
    speed = await expect_ok(await api.post(f"{A}/fellows/{fid}/speed",
                                           json={"tx_mbps": 10, "latency_ms": 5}, headers=AUTH),
                            202)
    job = await submit(api)
    await expect_ok(await api.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH))
    await expect_ok(await api.post(f"{A}/fellows/release", json={"fellow_ids": [fid]},
                                   headers=AUTH), 202)
    sigs = await poll(api, f)
    assert [s["kind"] for s in sigs] == ["SET_SPEED", "START", "STOP", "RELEASE"]
    seqs = [s["seq"] for s in sigs]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4 and seqs[0] == speed["signal_seq"]
    assert sigs[0]["payload"] == {"tx_mbps": 10.0, "rx_mbps": None, "latency_ms": 5.0}
    assert sigs[1]["job_id"] == job["job_id"] and sigs[1]["payload"]["stage"] == 0
    assert sigs[2]["job_id"] == job["job_id"] and "cancelled" in sigs[2]["payload"]["reason"]
    # ``after`` returns only newer signals and forgets the acknowledged ones.
    later = await poll(api, f, after=seqs[1])
    assert [s["seq"] for s in later] == seqs[2:]
    assert [s["seq"] for s in await poll(api, f, after=0)] == seqs[2:]
    assert await poll(api, f, after=seqs[-1]) == []


async def test_signal_long_poll_wakes_early(api):
    f = await register(api, "a")
    t0 = time.monotonic()
    waiter = asyncio.create_task(poll(api, f, wait=10))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json={"rx_mbps": 3}, headers=AUTH)
    sigs = await asyncio.wait_for(waiter, 5)
    elapsed = time.monotonic() - t0
    assert [s["kind"] for s in sigs] == ["SET_SPEED"]
    assert elapsed < 2.0


async def test_signal_poll_times_out_empty(api):
    f = await register(api, "a")
    t0 = time.monotonic()
    assert await poll(api, f, wait=0.2) == []
    assert 0.15 <= time.monotonic() - t0 < 2


@pytest.mark.parametrize(("query", "field"), [
    ({"wait": "-1"}, "wait"),
    ({"wait": "31"}, "wait"),
    ({"wait": "soon"}, "wait"),
    ({"wait": "nan"}, "wait"),
    ({"after": "-1"}, "after"),
    ({"after": "x"}, "after"),
])
async def test_signal_poll_bad_query_400(api, query, field):
    f = await register(api, "a")
    resp = await api.get(f"{A}/fellows/{f['fellow_id']}/signals", params=query,
                         headers=f["headers"])
    await expect_error(resp, 400, "invalid_param", field)


async def test_signal_poll_auth_401_403(api):
    a = await register(api, "a")
    b = await register(api, "b")
    url = f"{A}/fellows/{a['fellow_id']}/signals"
    await expect_error(await api.get(url), 401, "unauthorized")
    await expect_error(await api.get(url, headers=AUTH), 401, "unknown_session")
    await expect_error(await api.get(url, headers={**AUTH, SESSION_HEADER: "x"}), 401)
    await expect_error(await api.get(url, headers=b["headers"]), 403, "wrong_fellow")


# --- speed --------------------------------------------------------------------------------------


async def test_set_speed(api):
    f = await register(api, "a")
    resp = await api.post(f"{A}/fellows/{f['fellow_id']}/speed",
                          json={"tx_mbps": 2.5, "rx_mbps": 4, "latency_ms": 100}, headers=AUTH)
    body = await expect_ok(resp, 202)
    assert body["fellow_id"] == f["fellow_id"] and body["signal_seq"] == 1
    assert body["link"] == {"tx_mbps": 2.5, "rx_mbps": 4.0, "latency_ms": 100.0}
    # Unlimited again: an empty body means no limits.
    body = await expect_ok(await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json={},
                                          headers=AUTH), 202)
    assert body["link"] == {"tx_mbps": None, "rx_mbps": None, "latency_ms": 0.0}
    assert body["signal_seq"] == 2


async def test_a_set_speed_mid_job_is_recorded_in_the_job(api):
    """The fellow applies a set-speed at once: the running job's record says from which step
    its link changed; an idle fellow's set-speed names no job, nor does one after the job
    ended."""
    a = await register(api, "a")
    b = await register(api, "b")
    idle = await expect_ok(await api.post(f"{A}/fellows/{a['fellow_id']}/speed",
                                          json={"tx_mbps": 50}, headers=AUTH), 202)
    assert idle["job_id"] is None
    job = await submit(api, fellows=2)
    await expect_ok(await report(api, job["job_id"], b, "RUNNING", step=3))
    body = await expect_ok(await api.post(f"{A}/fellows/{b['fellow_id']}/speed",
                                          json={"tx_mbps": 8, "latency_ms": 40},
                                          headers=AUTH), 202)
    assert body["job_id"] == job["job_id"]
    changes = (await get_job(api, job["job_id"]))["link_changes"]
    assert [(c["at_step"], c["fellow_id"], c["link"]) for c in changes] == [
        (3, b["fellow_id"], {"tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 40.0})]
    await expect_ok(await api.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH))
    after = await expect_ok(await api.post(f"{A}/fellows/{b['fellow_id']}/speed", json={},
                                           headers=AUTH), 202)
    assert after["job_id"] is None, "an ended job's record stays as it ended"
    assert len((await get_job(api, job["job_id"]))["link_changes"]) == 1


async def test_a_job_keeps_its_first_set_speed_and_counts_them_all(api, monkeypatch):
    """The record of set-speeds is capped: it keeps the first (the step the run left its
    network profile) and the newest, and counts every one, so reports say "+N" truly."""
    monkeypatch.setattr("swarm_core.leader.queue.MAX_LINK_CHANGES", 6)
    b = (await register(api, "a"), await register(api, "b"))[1]
    job = await submit(api, fellows=2)
    seen = []
    for step, mbps in enumerate(range(10, 90, 10), start=1):
        await expect_ok(await report(api, job["job_id"], b, "RUNNING", step=step))
        await expect_ok(await api.post(f"{A}/fellows/{b['fellow_id']}/speed",
                                       json={"tx_mbps": mbps}, headers=AUTH), 202)
        info = await get_job(api, job["job_id"])
        seen.append([c["at_step"] for c in info["link_changes"]])
        assert info["link_changes_total"] == step
    # Up to the cap every change is kept; past it the first and the newest.
    assert seen == [list(range(1, n + 1)) for n in range(1, 7)] + [
        [1, 3, 4, 5, 6, 7], [1, 4, 5, 6, 7, 8]]


@pytest.mark.parametrize(("body", "field"), [
    ({"tx_mbps": -1}, "$.tx_mbps"),
    ({"rx_mbps": 0}, "$.rx_mbps"),
    ({"tx_mbps": 1e308}, "$.tx_mbps"),  # was taken, and read back as unlimited
    ({"rx_mbps": 1e-300}, "$.rx_mbps"),  # was taken: a link that never moves a frame
    ({"tx_mbps": "1"}, "$.tx_mbps"),
    ({"latency_ms": -0.1}, "$.latency_ms"),
    ({"latency_ms": 1e9}, "$.latency_ms"),
    ({"latency_ms": None}, "$.latency_ms"),
    ({"jitter_ms": 1}, "$"),
    ([1], "$"),
    ({"slowdown": 0.5}, "$.slowdown"),  # a peer cannot be emulated faster than it is
    ({"slowdown": 101}, "$.slowdown"),
    ({"slowdown": "4"}, "$.slowdown"),
    ({"tx_mbps": 8, "slowdown": 0}, "$.slowdown"),  # (and the link is not set either)
])
async def test_set_speed_bad_body_400(api, body, field):
    f = await register(api, "a")
    resp = await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json=body, headers=AUTH)
    await expect_error(resp, 400, "invalid_body", field)
    assert await poll(api, f) == []


async def test_set_speed_errors(api):
    f = await register(api, "a")
    await expect_error(await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json={}), 401)
    await expect_error(await api.post(f"{A}/fellows/7/speed", json={}, headers=AUTH),
                       404, "unknown_fellow")
    await expect_error(await api.post(f"{A}/fellows/x/speed", json={}, headers=AUTH),
                       404, "not_found")
    resp = await api.post(f"{A}/fellows/{f['fellow_id']}/speed", **raw(b"{"))
    await expect_error(resp, 400, "invalid_json")


async def test_set_speed_takes_a_slowdown_alone_or_beside_the_link(api):
    """``slowdown`` is optional: alone it changes the fellow's emulated compute slowdown and
    leaves its link (no link in the signal, ``link`` null in the answer); beside link fields it
    sets both; a link alone sends no slowdown, as before."""
    f = await register(api, "a")
    url = f"{A}/fellows/{f['fellow_id']}/speed"
    alone = await expect_ok(await api.post(url, json={"slowdown": 4}, headers=AUTH), 202)
    assert alone["link"] is None and alone["slowdown"] == 4.0
    both = await expect_ok(await api.post(url, json={"tx_mbps": 8, "slowdown": 1.5},
                                          headers=AUTH), 202)
    assert both["link"] == {"tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 0.0}
    assert both["slowdown"] == 1.5
    link = await expect_ok(await api.post(url, json={"rx_mbps": 2}, headers=AUTH), 202)
    assert link["slowdown"] is None
    sigs = await poll(api, f)
    assert [s["kind"] for s in sigs] == ["SET_SPEED"] * 3
    assert [s["payload"] for s in sigs] == [
        {"slowdown": 4.0},
        {"tx_mbps": 8.0, "rx_mbps": None, "latency_ms": 0.0, "slowdown": 1.5},
        {"tx_mbps": None, "rx_mbps": 2.0, "latency_ms": 0.0}]


async def test_a_slowdown_mid_job_is_recorded_as_emulation(api):
    """The running job's record of set-speeds keeps the slowdown beside the link changes (a
    slowdown alone: no link), from the step it was set."""
    b = (await register(api, "a"), await register(api, "b"))[1]
    job = await submit(api, fellows=2)
    await expect_ok(await report(api, job["job_id"], b, "RUNNING", step=5))
    body = await expect_ok(await api.post(f"{A}/fellows/{b['fellow_id']}/speed",
                                          json={"slowdown": 4}, headers=AUTH), 202)
    assert body["job_id"] == job["job_id"]
    changes = (await get_job(api, job["job_id"]))["link_changes"]
    assert [(c["at_step"], c["fellow_id"], c.get("link"), c["slowdown"]) for c in changes] == [
        (5, b["fellow_id"], None, 4.0)]
    assert "link" not in changes[0], "a slowdown alone names no link"


@pytest.mark.parametrize("gone", ["released", "leaving"])
async def test_set_speed_on_released_fellow_409(api, gone):
    f = await register(api, "a")
    await expect_ok(await api.post(f"{A}/fellows/release", json={"fellow_ids": [f["fellow_id"]]},
                                   headers=AUTH), 202)
    await heartbeat(api, f, status=gone, signal_seq=1)
    resp = await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json={"tx_mbps": 1},
                          headers=AUTH)
    await expect_error(resp, 409, "fellow_gone")


# --- release ------------------------------------------------------------------------------------


async def test_release_by_ids(api):
    a, b, c = [await register(api, n) for n in ("a", "b", "c")]
    ids = [a["fellow_id"], c["fellow_id"], a["fellow_id"]]
    body = await expect_ok(await api.post(f"{A}/fellows/release", json={"fellow_ids": ids},
                                          headers=AUTH), 202)
    assert body == {"released": [a["fellow_id"], c["fellow_id"]]}
    assert [s["kind"] for s in await poll(api, a)] == ["RELEASE"]
    assert [s["kind"] for s in await poll(api, c)] == ["RELEASE"]
    assert await poll(api, b) == []


async def test_release_all_skips_gone_fellows(api):
    a, b, c = [await register(api, n) for n in ("a", "b", "c")]
    await heartbeat(api, b, status="released")
    body = await expect_ok(await api.post(f"{A}/fellows/release", json={"all": True},
                                          headers=AUTH), 202)
    assert body == {"released": [a["fellow_id"], c["fellow_id"]]}
    assert [s["kind"] for s in await poll(api, a)] == ["RELEASE"]


async def test_releasing_a_gone_fellow_is_refused_and_releases_no_one(fast_api):
    """Issue 36, point 13: a fellow gone stale takes no signal, so "released" would be false;
    a release that names it is refused by name and sends nothing to the others it names;
    release-all passes it over."""
    a, b = [await register(fast_api, n) for n in ("a", "b")]
    await asyncio.sleep(0.5)  # (both stale: 0.3 s without a heartbeat)
    await heartbeat(fast_api, a)
    resp = await fast_api.post(f"{A}/fellows/release",
                               json={"fellow_ids": [a["fellow_id"], b["fellow_id"]]},
                               headers=AUTH)
    err = await expect_error(resp, 409, "fellow_gone")
    assert f"fellow {b['fellow_id']} (b) is stale" in err["message"]
    assert f"swarm forget --fellow-id {b['fellow_id']}" in err["message"]
    assert [s for s in await poll(fast_api, a) if s["kind"] == "RELEASE"] == []
    body = await expect_ok(await fast_api.post(f"{A}/fellows/release", json={"all": True},
                                               headers=AUTH), 202)
    assert body == {"released": [a["fellow_id"]]}


async def test_release_running_fellow_carries_job_id(api):
    f = await register(api, "a")
    job = await submit(api)
    await expect_ok(await api.post(f"{A}/fellows/release", json={"all": True}, headers=AUTH),
                    202)
    release = (await poll(api, f))[-1]
    assert release["kind"] == "RELEASE" and release["job_id"] == job["job_id"]


# --- forget -------------------------------------------------------------------------------------


async def test_forget_drops_a_gone_fellow_and_never_gives_its_id_again(aiohttp_client,
                                                                       leader_config):
    """A fellow that left (or went stale) is forgotten: gone from GET /fellows, also after a
    restart; its id is not given to the next fellow; a live one, or one that holds a cell of
    the running job, is refused with 409 and a one-line reason; an unknown one is 404."""
    api = await aiohttp_client(create_app(leader_config))
    a, b, c = [await register(api, n) for n in ("a", "b", "c")]
    resp = await api.delete(f"{A}/fellows/{c['fellow_id']}", headers=AUTH)
    err = await expect_error(resp, 409, "fellow_live")
    assert "still heartbeats" in err["message"] and "\n" not in err["message"]
    await heartbeat(api, c, status="released")
    body = await expect_ok(await api.delete(f"{A}/fellows/{c['fellow_id']}", headers=AUTH))
    assert body == {"fellow_id": c["fellow_id"], "name": "c", "status": "released"}
    fellows = (await expect_ok(await api.get(f"{A}/fellows", headers=AUTH)))["fellows"]
    assert [f["fellow_id"] for f in fellows] == [a["fellow_id"], b["fellow_id"]]
    await expect_error(await api.delete(f"{A}/fellows/{c['fellow_id']}", headers=AUTH), 404,
                       "unknown_fellow")
    await expect_error(await api.delete(f"{A}/fellows/{c['fellow_id']}"), 401)
    # Its id is not reused (finished jobs name it), also by a leader restarted on the state.
    d = await register(api, "d")
    assert d["fellow_id"] == c["fellow_id"] + 1
    await api.close()
    api = await aiohttp_client(create_app(leader_config))
    fellows = (await expect_ok(await api.get(f"{A}/fellows", headers=AUTH)))["fellows"]
    assert [f["fellow_id"] for f in fellows] == [a["fellow_id"], b["fellow_id"], d["fellow_id"]]
    assert all(f["status"] == "offline" for f in fellows)
    # Offline (not heard since the restart) but holding a cell of the running job: refused.
    a = await register(api, "a")
    job = await submit(api)
    assert job["fellows"] == [a["fellow_id"]]
    await heartbeat(api, a, status="released")  # (gone, but its cell is the job's)
    err = await expect_error(await api.delete(f"{A}/fellows/{a['fellow_id']}", headers=AUTH),
                             409, "fellow_in_job")
    assert job["job_id"] in err["message"]
    # One that was never heard from since the restart is forgotten.
    await expect_ok(await api.delete(f"{A}/fellows/{b['fellow_id']}", headers=AUTH))
    e = await register(api, "e")
    assert e["fellow_id"] == d["fellow_id"] + 1


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"fellow_ids": [0], "all": True}, 400, "$"),
    ({}, 400, "$"),
    ({"fellow_ids": [], "all": False}, 400, "$"),
    ({"fellow_ids": ["0"]}, 400, "$.fellow_ids[0]"),
    ({"fellow_ids": [0, -1]}, 400, "$.fellow_ids[1]"),
    ({"fellow_ids": 0}, 400, "$.fellow_ids"),
    ({"all": "yes"}, 400, "$.all"),
    ({"all": 1}, 400, "$.all"),
    ({"all": True, "force": True}, 400, "$"),
    ({"fellow_ids": [0, 42]}, 404, None),
])
async def test_release_errors(api, body, status, field):
    f = await register(api, "a")
    resp = await api.post(f"{A}/fellows/release", json=body, headers=AUTH)
    await expect_error(resp, status, "unknown_fellow" if status == 404 else "invalid_body", field)
    # Nothing was released, not even the valid ids of a request that failed.
    assert await poll(api, f) == []


async def test_release_needs_token(api):
    await expect_error(await api.post(f"{A}/fellows/release", json={"all": True}), 401)


# --- nodes --------------------------------------------------------------------------------------


async def test_nodes_report_control_plane_bytes(api):
    a = await register(api, "a", host="h-a")
    b = await register(api, "b")
    await heartbeat(api, a, counters={"control_tx": 1500, "control_rx": 2500, "data_tx": 7,
                                      "data_rx": 9})
    await heartbeat(api, a, counters={"control_tx": 3000, "control_rx": 4000, "data_tx": 8,
                                      "data_rx": 10})
    await expect_error(await api.get(f"{A}/nodes"), 401)
    nodes = (await expect_ok(await api.get(f"{A}/nodes", headers=AUTH)))["nodes"]
    by_id = {n["fellow_id"]: n for n in nodes}
    assert by_id[a["fellow_id"]] == {
        "fellow_id": a["fellow_id"], "name": "a", "host": "h-a", "status": "ready",
        "control_tx": 3000, "control_rx": 4000, "data_tx": 8, "data_rx": 10}
    assert by_id[b["fellow_id"]]["control_tx"] == 0


# --- jobs ---------------------------------------------------------------------------------------


async def test_submit_pending_explains_waiting(api):
    await register(api, "a")
    job = await submit(api, fellows=2, name="big", kind="train",
                       model={"d_model": 64}, training={"steps": 10})
    assert job["state"] == "PENDING" and job["job_id"].startswith("job-")
    assert job["waiting_for"] == "needs 2 ready fellow(s), 1 ready"
    assert job["name"] == "big" and job["kind"] == "train"
    # Train configs come back resolved: what was given, plus every default filled in.
    assert job["model"]["d_model"] == 64 and job["model"]["n_layers"] == 4
    assert job["training"]["steps"] == 10 and job["training"]["schedule"] == "1f1b"
    assert job["topology"] == {"fellows": 2, "slots_per_fellow": 1, "stages": 2, "replicas": 1,
                               "wiring": "chain", "route_weights": None,
                               "routing": "given"} \
        and job["fellows"] == []
    assert job["started_at"] is None and job["finished_at"] is None
    second = await submit(api, fellows=1)
    assert second["state"] == "PENDING"
    assert second["waiting_for"] == "1 job(s) ahead in the queue"


async def test_submit_defaults(api):
    job = await expect_ok(await api.post(f"{A}/jobs", json={}, headers=AUTH), 201)
    assert (job["name"], job["kind"], job["topology"]) == \
        ("job", "train", {"fellows": 1, "slots_per_fellow": 1, "stages": 1, "replicas": 1,
                          "wiring": "chain", "route_weights": None, "routing": "given"})
    assert job["waiting_for"] == "needs 1 ready fellow(s), 0 ready"
    # A body that is not there is not {}: refused, and nothing is queued.
    resp = await api.post(f"{A}/jobs", data=b"", headers=AUTH)
    assert resp.status == 400
    assert "empty body" in (await resp.json())["error"]["message"]
    jobs = await expect_ok(await api.get(f"{A}/jobs", headers=AUTH))
    assert [j["job_id"] for j in jobs["jobs"]] == [job["job_id"]]


@pytest.mark.parametrize(("body", "field"), [
    ({"topology": {"fellows": 0}}, "$.topology.fellows"),
    ({"topology": {"fellows": 2000}}, "$.topology.fellows"),
    ({"topology": {"fellows": "2"}}, "$.topology.fellows"),
    ({"topology": {"slots": 2}}, "$.topology"),
    ({"topology": {"fellows": 3, "slots_per_fellow": 0}}, "$.topology.slots_per_fellow"),
    ({"topology": None}, "$.topology"),
    ({"kind": "eval"}, "$.kind"),
    ({"name": ""}, "$.name"),
    ({"model": []}, "$.model"),
    ({"training": "x"}, "$.training"),
    ({"priority": 1}, "$"),
    (3, "$"),
])
async def test_submit_bad_body_400(api, body, field):
    await expect_error(await api.post(f"{A}/jobs", json=body, headers=AUTH), 400,
                       "invalid_body", field)
    assert (await expect_ok(await api.get(f"{A}/jobs", headers=AUTH)))["jobs"] == []


async def test_submit_errors(api):
    await expect_error(await api.post(f"{A}/jobs", json={}), 401)
    await expect_error(await api.post(f"{A}/jobs", **raw(b"{]")), 400, "invalid_json")
    await expect_error(await api.post(f"{A}/jobs", **raw(b"{}", "text/plain")), 415)
    big = {"model": {"w": "x" * (1 << 20)}}
    await expect_error(await api.post(f"{A}/jobs", **raw(orjson.dumps(big))), 413)


async def test_submit_deeply_nested_config_400(api):
    # orjson reads 300 levels but cannot write them back: such a job could never be stored,
    # nor its START signal sent.
    body = b'{"kind":"smoke","model":{"x":1},"training":' + _nested_json(300) + b"}"
    resp = await api.post(f"{A}/jobs", **raw(body))
    await expect_error(resp, 400, "invalid_body", "$.training")
    f = await register(api, "a")
    # Nothing half-stored: the fellow is still free and gets no START.
    assert await poll(api, f) == []
    assert (await expect_ok(await api.get(f"{A}/jobs", headers=AUTH)))["jobs"] == []
    # Within the limit, a smoke job's body is checked like any other: it takes no model, and
    # its training names steps and step_seconds only (both used to pass, then fail later).
    for body, field, message in (
            (b'{"kind":"smoke","model":' + _nested_json(63) + b"}", "$.model",
             "a smoke job takes no model"),
            (b'{"kind":"smoke","training":{"steps":-3}}', "$.training.steps",
             "must be 1-100000, got -3"),
            (b'{"kind":"smoke","training":{"bogus":1}}', "$.training", "unknown field")):
        err = await expect_error(await api.post(f"{A}/jobs", **raw(body)), 400, field=field)
        assert message in err["message"]
    assert await poll(api, f) == []
    job = await expect_ok(await api.post(f"{A}/jobs", **raw(
        b'{"kind":"smoke","training":{"steps":2,"step_seconds":0}}')), 201)
    assert job["training"] == {"steps": 2, "step_seconds": 0.0}
    start = (await poll(api, f))[0]
    assert start["kind"] == "START" and start["payload"]["training"] == job["training"]


def _nested_json(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


async def test_dispatch_starts_job_and_sends_start(api, leader_config):
    a = await register(api, "a", data_addr="127.0.0.1:1")
    job = await submit(api, fellows=2, training={"steps": 3})
    assert job["state"] == "PENDING"
    assert await poll(api, a) == []
    b = await register(api, "b", data_addr="127.0.0.1:2")
    job = await get_job(api, job["job_id"])
    assert job["state"] == "RUNNING" and job["waiting_for"] == ""
    assert sorted(job["fellows"]) == sorted([a["fellow_id"], b["fellow_id"]])
    assert job["started_at"] is not None
    starts = [(await poll(api, f))[0] for f in (a, b)]
    assert all(s["kind"] == "START" and s["job_id"] == job["job_id"] for s in starts)
    assert sorted(s["payload"]["stage"] for s in starts) == [0, 1]
    for s in starts:
        p = s["payload"]
        assert p["num_stages"] == 2 and p["job_id"] == job["job_id"]
        assert p["training"] == {"steps": 3, "step_seconds": 0.2} and p["kind"] == "smoke"
        stages = p["placement"]["stages"]
        assert [(x["stage"], x["fellow_id"]) for x in stages] == [
            (0, job["fellows"][0]), (1, job["fellows"][1])]
        assert {x["data_addr"] for x in stages} == {"127.0.0.1:1", "127.0.0.1:2"}
        assert len(p["key"]) == 32  # the job's data-plane session key
    assert job["placement"] == starts[0]["payload"]["placement"]
    # The plan is an artifact of the run too: the same global layer ranges, fellows and slots.
    plan_file = leader_config.state_dir / "runs" / job["job_id"] / "placement_plan.json"
    assert orjson.loads(plan_file.read_bytes()) == job["placement"]
    view = await get_fellow(api, a["fellow_id"])
    assert view["current_job"] == job["job_id"]


async def test_only_one_job_runs_oldest_first(api):
    fellows = [await register(api, n) for n in ("a", "b", "c")]
    first = await submit(api, fellows=1, name="first")
    second = await submit(api, fellows=1, name="second")
    first = await get_job(api, first["job_id"])
    second = await get_job(api, second["job_id"])
    assert first["state"] == "RUNNING"
    # Two fellows are idle, but only one job runs at a time.
    assert second["state"] == "PENDING"
    assert second["waiting_for"] == f"job {first['job_id']} is running"
    runner = next(f for f in fellows if f["fellow_id"] == first["fellows"][0])
    await expect_ok(await report(api, first["job_id"], runner, "COMPLETED", step=5))
    second = await get_job(api, second["job_id"])
    assert second["state"] == "RUNNING"
    running = await expect_ok(await api.get(f"{A}/jobs", params={"state": "running"},
                                            headers=AUTH))
    assert [j["job_id"] for j in running["jobs"]] == [second["job_id"]]


async def test_status_updates_advance_last_step(api):
    a = await register(api, "a")
    b = await register(api, "b")
    job = await submit(api, fellows=2)
    jid = job["job_id"]
    steps = [(a, 3), (b, 5), (a, 4), (b, 9), (a, 2)]
    seen = []
    for f, step in steps:
        body = await expect_ok(await report(api, jid, f, "RUNNING", step=step, loss=1.0 / step,
                                            tokens_per_s=10.0))
        assert body["state"] == "RUNNING"
        seen.append(body["last_step"])
    assert seen == [3, 5, 5, 9, 9]
    assert (await get_job(api, jid))["last_loss"] == 0.5


async def test_all_fellows_completed_completes_job(api):
    a = await register(api, "a")
    b = await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    body = await expect_ok(await report(api, jid, a, "COMPLETED", step=10))
    assert body["state"] == "RUNNING"
    # Completing twice is harmless.
    body = await expect_ok(await report(api, jid, a, "COMPLETED", step=10))
    assert body["state"] == "RUNNING"
    body = await expect_ok(await report(api, jid, b, "COMPLETED", step=10, message="done"))
    assert body["state"] == "COMPLETED" and body["finished_at"] is not None
    assert body["reason"] == "done" and body["last_step"] == 10
    # Completed fellows get no STOP, and are free again.
    assert [s["kind"] for s in await poll(api, a)] == ["START"]
    assert (await get_fellow(api, a["fellow_id"]))["current_job"] is None


async def test_failed_fellow_fails_job(api):
    a = await register(api, "a")
    b = await register(api, "b", "b-inst")
    jid = (await submit(api, fellows=2))["job_id"]
    await expect_ok(await report(api, jid, a, "RUNNING", step=3))
    body = await expect_ok(await report(api, jid, b, "FAILED", step=4, message="CUDA OOM"))
    assert body["state"] == "FAILED"
    assert f"fellow {b['fellow_id']} (b)" in body["reason"]
    assert "step 4" in body["reason"] and "CUDA OOM" in body["reason"]
    # The other fellow is told to stop.
    sigs = await poll(api, a)
    assert [s["kind"] for s in sigs] == ["START", "STOP"]
    assert sigs[1]["job_id"] == jid and body["reason"] in sigs[1]["payload"]["reason"]


@pytest.mark.parametrize("cause", ["report", "stale", "none"])
async def test_a_failure_that_blames_a_neighbour_waits_for_the_cause(make_api, cause):
    """A stage whose link to its neighbour closed reports FAILED blaming that stage. The job
    holds on for up to the stale timeout plus one heartbeat interval: the neighbour's own
    report, or its going stale, names the cause; with neither, the survivor's reason stands."""
    api = await make_api(stale_after_s=1.0, heartbeat_interval_s=0.5)
    a = await register(api, "a")
    b = await register(api, "b", "b-inst")
    jid = (await submit(api, fellows=2))["job_id"]
    alive = {a["fellow_id"], b["fellow_id"]}
    async with beating(api, [a, b], 4, alive):
        stages = (await get_job(api, jid))["fellows"]
        sa, sb = stages.index(a["fellow_id"]), stages.index(b["fellow_id"])
        t0 = time.monotonic()
        body = await expect_ok(await report(api, jid, a, "FAILED", step=4, stage=sa,
                                            blames_stage=sb,
                                            message="LinkClosed: stage 1 closed the link"))
        assert body["state"] == "RUNNING", "held for the cause"
        if cause == "stale":
            alive.discard(b["fellow_id"])  # as if b had died with the link
        if cause == "report":
            body = await expect_ok(await report(api, jid, b, "FAILED", step=4, stage=sb,
                                                message="FrameError: bad magic"))
            assert body["state"] == "FAILED"
            assert body["reason"] == \
                f"fellow {b['fellow_id']} (b) failed at step 4: FrameError: bad magic"
            return
        job = await wait_until_failed(api, jid)
    if cause == "stale":
        assert job["reason"] == f"fellow {b['fellow_id']} (b) stopped heartbeating at step 4"
    else:
        assert time.monotonic() - t0 >= 1.5  # stale_after + one heartbeat interval
        assert job["reason"] == f"fellow {a['fellow_id']} (a) failed at step 4: LinkClosed: " \
                                "stage 1 closed the link"


async def test_a_held_failure_survives_a_leader_restart(aiohttp_client, tmp_path):
    """The leader restarts while it holds a failure that blames a live neighbour: the held
    reason is kept, and once the wait runs out again the job fails with it (it does not stay
    RUNNING for ever with every fellow alive and idle)."""
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05,
                       stale_after_s=1.0, heartbeat_interval_s=0.5)
    api = await aiohttp_client(create_app(cfg))
    a = await register(api, "a")
    b = await register(api, "b", "b-inst")
    jid = (await submit(api, fellows=2))["job_id"]
    stages = (await get_job(api, jid))["fellows"]
    sa, sb = stages.index(a["fellow_id"]), stages.index(b["fellow_id"])
    body = await expect_ok(await report(api, jid, a, "FAILED", step=3, stage=sa,
                                        blames_stage=sb, message="LinkClosed: closed"))
    assert body["state"] == "RUNNING"
    await api.close()

    api = await aiohttp_client(create_app(cfg))
    a = await register(api, "a")  # the same processes: sessions are per leader
    b = await register(api, "b", "b-inst")

    async def failed() -> dict[str, Any] | None:
        for reg in (a, b):
            await heartbeat(api, reg, status="ready")
        job = await get_job(api, jid)
        return job if job["state"] == "FAILED" else None

    job = await wait_for(failed, timeout=5.0, interval=0.05)
    assert job["reason"] == f"fellow {a['fellow_id']} (a) failed at step 3: LinkClosed: closed"


@pytest.mark.parametrize("blames", ["own", "beyond", "done"])
async def test_a_failure_blaming_no_neighbour_that_could_answer_fails_at_once(api, blames):
    """Only a running neighbour one stage away is waited for: blaming the reporter's own stage,
    a stage past the pipeline, or a stage that already finished fails the job at once."""
    a = await register(api, "a")
    b = await register(api, "b", "b-inst")
    jid = (await submit(api, fellows=2))["job_id"]
    stages = (await get_job(api, jid))["fellows"]
    sa, sb = stages.index(a["fellow_id"]), stages.index(b["fellow_id"])
    if blames == "done":
        await expect_ok(await report(api, jid, b, "COMPLETED", step=2, stage=sb))
    target = {"own": sa, "beyond": 2, "done": sb}[blames]
    body = await expect_ok(await report(api, jid, a, "FAILED", step=2, stage=sa,
                                        blames_stage=target, message="odd"))
    assert body["state"] == "FAILED" and body["reason"].endswith("failed at step 2: odd")


async def test_in_a_chain_the_blamed_stages_own_blame_is_nearer_the_cause(make_api):
    """Stage 2 hangs: stage 1 times out blaming 2, and stage 0, whose link stage 1 then closed,
    blames 1. Whichever arrives first, the job ends with stage 1's reason."""
    api = await make_api(stale_after_s=1.0, heartbeat_interval_s=0.5)
    regs = [await register(api, n, f"{n}-inst") for n in ("a", "b", "c")]
    jid = (await submit(api, fellows=3))["job_id"]
    stages = (await get_job(api, jid))["fellows"]
    by_stage = sorted(regs, key=lambda r: stages.index(r["fellow_id"]))
    async with beating(api, regs, 5):
        body = await expect_ok(await report(api, jid, by_stage[0], "FAILED", step=5, stage=0,
                                            blames_stage=1, message="LinkClosed: closed"))
        assert body["state"] == "RUNNING"
        body = await expect_ok(await report(api, jid, by_stage[1], "FAILED", step=5, stage=1,
                                            blames_stage=2, message="PeerTimeout: quiet"))
        assert body["state"] == "RUNNING"
        job = await wait_until_failed(api, jid)
    names = {r["fellow_id"]: n for r, n in zip(regs, "abc", strict=True)}
    fid = by_stage[1]["fellow_id"]
    assert job["reason"] == f"fellow {fid} ({names[fid]}) failed at step 5: PeerTimeout: quiet"


async def test_cancel_pending_job(api):
    job = await submit(api, fellows=3)
    body = await expect_ok(await api.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH))
    assert body["state"] == "CANCELLED" and body["reason"] == "cancelled by request"
    assert body["finished_at"] is not None and body["waiting_for"] == ""


async def test_cancel_running_job_sends_stop(api):
    a = await register(api, "a")
    b = await register(api, "b")
    job = await submit(api, fellows=2)
    body = await expect_ok(await api.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH))
    assert body["state"] == "CANCELLED"
    for f in (a, b):
        sigs = await poll(api, f)
        assert [s["kind"] for s in sigs] == ["START", "STOP"]
        assert sigs[1]["job_id"] == job["job_id"]
        assert (await get_fellow(api, f["fellow_id"]))["current_job"] is None
    # The fellows are free: the next job starts at once.
    assert (await submit(api, fellows=2))["state"] == "RUNNING"


async def test_cancel_errors(api):
    await expect_error(await api.post(f"{A}/jobs/job-999999/cancel", headers=AUTH), 404,
                       "unknown_job")
    job = await submit(api)
    await expect_error(await api.post(f"{A}/jobs/{job['job_id']}/cancel"), 401)
    await expect_ok(await api.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH))
    err = await expect_error(await api.post(f"{A}/jobs/{job['job_id']}/cancel", headers=AUTH),
                             409, "job_finished")
    assert "CANCELLED" in err["message"]
    f = await register(api, "a")
    done = await submit(api)
    await expect_ok(await report(api, done["job_id"], f, "COMPLETED"))
    await expect_error(await api.post(f"{A}/jobs/{done['job_id']}/cancel", headers=AUTH),
                       409, "job_finished")


async def test_list_and_get_jobs(api):
    a = await register(api, "a")
    j1 = await submit(api, name="one")
    j2 = await submit(api, name="two")
    j3 = await submit(api, name="three")
    await expect_ok(await api.post(f"{A}/jobs/{j3['job_id']}/cancel", headers=AUTH))
    await expect_error(await api.get(f"{A}/jobs"), 401)
    listed = await expect_ok(await api.get(f"{A}/jobs", headers=AUTH))
    assert [j["job_id"] for j in listed["jobs"]] == [j1["job_id"], j2["job_id"], j3["job_id"]]

    async def ids(state: str) -> list[str]:
        body = await expect_ok(await api.get(f"{A}/jobs", params={"state": state},
                                             headers=AUTH))
        return [j["job_id"] for j in body["jobs"]]

    assert await ids("RUNNING") == [j1["job_id"]]
    assert await ids("pending") == [j2["job_id"]]
    assert await ids("Cancelled") == [j3["job_id"]]
    assert await ids("FAILED") == []
    assert (await get_job(api, j1["job_id"]))["fellows"] == [a["fellow_id"]]
    err = await expect_error(await api.get(f"{A}/jobs", params={"state": "done"},
                                           headers=AUTH), 400, "invalid_param", "state")
    assert "PENDING" in err["message"]
    await expect_error(await api.get(f"{A}/jobs/job-424242", headers=AUTH), 404, "unknown_job")
    await expect_error(await api.get(f"{A}/jobs/{j1['job_id']}"), 401)


async def test_jobs_come_a_page_at_a_time(api):
    jobs = [(await submit(api, name=f"j{i}"))["job_id"] for i in range(5)]

    async def page(**params: Any) -> tuple[list[str], str | None]:
        body = await expect_ok(await api.get(f"{A}/jobs", params=params, headers=AUTH))
        return [j["job_id"] for j in body["jobs"]], body["next_after"]

    assert await page() == (jobs, None)
    assert await page(limit="2") == (jobs[:2], jobs[1])
    assert await page(limit="2", after=jobs[1]) == (jobs[2:4], jobs[3])
    assert await page(limit="2", after=jobs[3]) == (jobs[4:], None)
    assert await page(after=jobs[4]) == ([], None)
    assert await page(limit="5") == (jobs, None)
    # The queue's account of each pending job is the same on any page.
    body = await expect_ok(await api.get(f"{A}/jobs", params={"after": jobs[2]}, headers=AUTH))
    assert [j["waiting_for"] for j in body["jobs"]] == ["3 job(s) ahead in the queue",
                                                        "4 job(s) ahead in the queue"]
    for params, field in (({"limit": "0"}, "limit"), ({"limit": "10001"}, "limit"),
                          ({"limit": "x"}, "limit"), ({"after": "job-424242"}, "after")):
        await expect_error(await api.get(f"{A}/jobs", params=params, headers=AUTH), 400,
                           "invalid_param", field)


async def test_jobs_list_newest_first_or_by_finish_with_a_total(api):
    jobs = [(await submit(api, name=f"j{i}"))["job_id"] for i in range(6)]
    # Finished out of submission order: the latest to finish comes first in order=finished.
    for jid in (jobs[4], jobs[1], jobs[3]):
        await expect_ok(await api.post(f"{A}/jobs/{jid}/cancel", headers=AUTH))

    async def page(**params: Any) -> tuple[list[str], str | None, int]:
        body = await expect_ok(await api.get(f"{A}/jobs", params=params, headers=AUTH))
        return [j["job_id"] for j in body["jobs"]], body["next_after"], body["total"]

    assert await page(order="newest", limit="4") == (jobs[:-5:-1], jobs[2], 6)
    assert await page(order="newest", limit="4", after=jobs[2]) == ([jobs[1], jobs[0]], None, 6)
    assert await page(order="finished", limit="2") == ([jobs[3], jobs[1]], jobs[1], 3)
    assert await page(order="finished", limit="2", after=jobs[1]) == ([jobs[4]], None, 3)
    assert await page(order="finished", state="cancelled") == ([jobs[3], jobs[1], jobs[4]],
                                                              None, 3)
    # Several states at once, comma-separated; total counts them on every page.
    assert await page(state="pending,cancelled", limit="2") == (jobs[0:2], jobs[1], 6)
    assert await page(state="PENDING", limit="1", after=jobs[2]) == ([jobs[5]], None, 3)
    assert await page(state="running,pending", order="newest") == (
        [jobs[5], jobs[2], jobs[0]], None, 3)
    for params, field in (({"order": "oldest"}, "order"),
                          ({"order": "finished", "state": "pending"}, "state"),
                          ({"order": "finished", "after": jobs[0]}, "after"),
                          ({"state": "pending,"}, "state"), ({"state": "done,running"}, "state")):
        await expect_error(await api.get(f"{A}/jobs", params=params, headers=AUTH), 400,
                           "invalid_param", field)


async def test_a_page_of_jobs_builds_only_that_page(api, monkeypatch):
    """A console refreshing the newest of 10k jobs every second serialized all 10k each time
    (GET /jobs p99 and every heartbeat with it went past half a second)."""
    from swarm_core.leader.queue import JobQueue

    jobs = [(await submit(api, name=f"j{i}"))["job_id"] for i in range(30)]
    for jid in jobs[1:]:
        await expect_ok(await api.post(f"{A}/jobs/{jid}/cancel", headers=AUTH))
    built: list[str] = []
    real = JobQueue.info

    def counted(self, job, *args, **kwargs):
        built.append(job.job_id)
        return real(self, job, *args, **kwargs)

    monkeypatch.setattr(JobQueue, "info", counted)
    body = await expect_ok(await api.get(f"{A}/jobs", params={"order": "finished", "limit": "5"},
                                         headers=AUTH))
    assert [j["job_id"] for j in body["jobs"]] == jobs[:-6:-1] == built
    assert body["total"] == 29


async def test_listing_jobs_orders_the_queue_once(api, monkeypatch):
    """Each pending job's place in the queue came from a scan of every job, so listing n jobs
    cost n^2 (10k pending jobs took minutes and stalled every heartbeat). The queue's order
    is built once per change of the queue, not per job or per listing."""
    from swarm_core.leader import queue

    for i in range(40):
        await submit(api, name=f"j{i}")
    built = 0
    real = queue.QueueOrder

    def counted(*args, **kwargs):
        nonlocal built
        built += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(queue, "QueueOrder", counted)
    for _ in range(2):
        body = await expect_ok(await api.get(f"{A}/jobs", headers=AUTH))
        assert len(body["jobs"]) == 40 and body["jobs"][39]["waiting_for"] == \
            "39 job(s) ahead in the queue"
    assert built <= 1


async def test_job_status_auth_errors(api):
    a = await register(api, "a")
    b = await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    url = f"{A}/jobs/{jid}/status"
    body = {"fellow_id": a["fellow_id"], "state": "RUNNING", "step": 1}
    await expect_error(await api.post(url, json=body), 401, "unauthorized")
    await expect_error(await api.post(url, json=body, headers=AUTH), 401, "unknown_session")
    await expect_error(await api.post(url, json=body, headers={**AUTH, SESSION_HEADER: "zz"}),
                       401, "unknown_session")
    # b's session speaking for a.
    await expect_error(await api.post(url, json=body, headers=b["headers"]), 403, "wrong_fellow")
    assert (await get_job(api, jid))["last_step"] == 0


async def test_job_status_state_errors(api):
    a = await register(api, "a")
    b = await register(api, "b")
    jid = (await submit(api, fellows=1))["job_id"]
    runner, idle = (a, b) if (await get_job(api, jid))["fellows"] == [a["fellow_id"]] else (b, a)
    await expect_error(await report(api, "job-777777", runner, "RUNNING"), 404, "unknown_job")
    err = await expect_error(await report(api, jid, idle, "RUNNING", step=1), 409, "not_in_job",
                             "$.fellow_id")
    assert str(idle["fellow_id"]) in err["message"]
    pending = (await submit(api, fellows=1))["job_id"]
    await expect_error(await report(api, pending, runner, "RUNNING"), 409)
    await expect_ok(await report(api, jid, runner, "COMPLETED", step=2))
    # Finished: no more status, not even from its own fellow.
    err = await expect_error(await report(api, jid, runner, "RUNNING", step=3), 409,
                             "job_not_running")
    assert "COMPLETED" in err["message"]
    assert (await get_job(api, jid))["last_step"] == 2


@pytest.mark.parametrize(("body", "field"), [
    ({"state": "RUNNING"}, "$.fellow_id"),
    ({"fellow_id": 0}, "$.state"),
    ({"fellow_id": 0, "state": "PENDING"}, "$.state"),
    ({"fellow_id": 0, "state": "RUNNING", "step": -1}, "$.step"),
    ({"fellow_id": 0, "state": "RUNNING", "step": 1.5}, "$.step"),
    ({"fellow_id": -1, "state": "RUNNING"}, "$.fellow_id"),
    ({"fellow_id": 0, "state": "RUNNING", "loss": "low"}, "$.loss"),
    ({"fellow_id": 0, "state": "RUNNING", "tokens_per_s": -1}, "$.tokens_per_s"),
    ({"fellow_id": 0, "state": "FAILED", "message": "m" * 4097}, "$.message"),
    ({"fellow_id": 0, "state": "RUNNING", "extra": 1}, "$"),
])
async def test_job_status_bad_body_400(api, body, field):
    f = await register(api, "a")
    jid = (await submit(api))["job_id"]
    resp = await api.post(f"{A}/jobs/{jid}/status", json=body, headers=f["headers"])
    await expect_error(resp, 400, "invalid_body", field)
    assert (await get_job(api, jid))["state"] == "RUNNING"


async def test_job_status_invalid_json_400(api):
    f = await register(api, "a")
    jid = (await submit(api))["job_id"]
    resp = await api.post(f"{A}/jobs/{jid}/status", data=b"[",
                          headers={**f["headers"], "Content-Type": "application/json"})
    await expect_error(resp, 400, "invalid_json")


# --- liveness -----------------------------------------------------------------------------------


async def test_stale_fellow_fails_running_job(fast_api):
    api = fast_api
    a = await register(api, "a")
    b = await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    await heartbeat(api, b, status="busy", current_step=7)
    await expect_ok(await report(api, jid, b, "RUNNING", step=7))

    async def a_beats_and_job_failed():
        await heartbeat(api, a, status="busy", current_step=8)
        job = await get_job(api, jid)
        return job if job["state"] == "FAILED" else None

    t0 = time.monotonic()
    job = await wait_for(a_beats_and_job_failed, timeout=5.0, interval=0.05)
    assert time.monotonic() - t0 < 3.0
    assert job["reason"] == f"fellow {b['fellow_id']} (b) stopped heartbeating at step 7"
    assert (await get_fellow(api, b["fellow_id"]))["status"] == "stale"
    assert (await get_fellow(api, a["fellow_id"]))["status"] == "busy"
    # The fellow that is still alive is told to stop.
    assert [s["kind"] for s in await poll(api, a)] == ["START", "STOP"]


async def test_stale_fellow_is_not_ready(fast_api):
    api = fast_api
    f = await register(api, "a")
    await wait_for(lambda: _status_is(api, f["fellow_id"], "stale"))
    job = await submit(api)
    assert job["state"] == "PENDING"
    assert job["waiting_for"] == "needs 1 ready fellow(s), 0 ready"
    # A heartbeat brings it back and the dispatcher starts the job.
    await heartbeat(api, f)
    assert (await get_job(api, job["job_id"]))["state"] == "RUNNING"


# --- events -------------------------------------------------------------------------------------


async def test_events_need_token(api):
    with pytest.raises(WSServerHandshakeError) as exc:
        await api.ws_connect(f"{A}/events")
    assert exc.value.status == 401
    with pytest.raises(WSServerHandshakeError) as exc:
        await api.ws_connect(f"{A}/events", headers={"Authorization": "Bearer nope"})
    assert exc.value.status == 401


async def test_events_stream_fellow_job_and_metric(api):
    async with api.ws_connect(f"{A}/events", headers=AUTH) as ws:
        hello = orjson.loads(await ws.receive_bytes(timeout=2))
        assert hello["type"] == "hello" and isinstance(hello["seq"], int)
        f = await register(api, "a")
        ev = await next_event(ws, "fellow.registered")
        assert ev["data"]["fellow_id"] == f["fellow_id"] and ev["data"]["name"] == "a"
        await heartbeat(api, f, counters={"control_tx": 5})
        ev = await next_event(ws, "fellow.heartbeat")
        assert ev["data"]["counters"]["control_tx"] == 5
        await heartbeat(api, f, status="busy")
        ev = await next_event(ws, "fellow.status")
        assert ev["data"]["status"] == "busy"
        await heartbeat(api, f)
        await api.post(f"{A}/fellows/{f['fellow_id']}/speed", json={"tx_mbps": 3}, headers=AUTH)
        ev = await next_event(ws, "fellow.set_speed")
        assert ev["data"]["tx_mbps"] == 3.0
        jid = (await submit(api))["job_id"]
        submitted = (await next_event(ws, "job.submitted"))["data"]
        assert (submitted["job_id"], submitted["kind"]) == (jid, "smoke")
        started = await next_event(ws, "job.started")
        assert started["data"]["fellows"] == [f["fellow_id"]]
        await report(api, jid, f, "RUNNING", step=3, loss=1.25)
        metric = await next_event(ws, "metric")
        assert metric["data"] == {"job_id": jid, "fellow_id": f["fellow_id"], "stage": 0,
                                  "step": 3, "loss": 1.25, "tokens_per_s": None,
                                  "state": "RUNNING", "metrics": {}}
        await report(api, jid, f, "COMPLETED", step=4)
        done = await next_event(ws, "job.completed")
        assert done["data"]["state"] == "COMPLETED" and done["data"]["last_step"] == 4
        assert metric["seq"] < done["seq"]
        await api.post(f"{A}/fellows/release", json={"all": True}, headers=AUTH)
        assert (await next_event(ws, "fellow.release"))["data"]["name"] == "a"


async def test_events_filters(api):
    f = await register(api, "a")
    g = await register(api, "b")
    job1 = await submit(api)
    runner = f if (await get_job(api, job1["job_id"]))["fellows"] == [f["fellow_id"]] else g
    async with api.ws_connect(f"{A}/events", params={"types": "job"}, headers=AUTH) as jobs_ws, \
            api.ws_connect(f"{A}/events", params={"job_id": job1["job_id"]},
                           headers=AUTH) as one_ws, \
            api.ws_connect(f"{A}/events", params={"types": "metric,fellow"},
                           headers=AUTH) as mf_ws:
        for ws in (jobs_ws, one_ws, mf_ws):
            assert orjson.loads(await ws.receive_bytes(timeout=2))["type"] == "hello"
        await heartbeat(api, f)
        await report(api, job1["job_id"], runner, "RUNNING", step=1)
        await report(api, job1["job_id"], runner, "COMPLETED", step=2)
        job2 = await submit(api)
        jobs_events = await collect_until(jobs_ws, "job.started", job_id=job2["job_id"])
        one_events = await collect_until(one_ws, "job.completed")
        mf_events = await collect_until(mf_ws, "metric", state="COMPLETED")
    assert jobs_events and all(e["type"].startswith("job.") for e in jobs_events)
    assert {e["data"]["job_id"] for e in jobs_events} == {job1["job_id"], job2["job_id"]}
    assert one_events and all(e["data"].get("job_id") == job1["job_id"] for e in one_events)
    assert {e["type"] for e in one_events} >= {"metric", "job.completed"}
    assert {e["type"].split(".")[0] for e in mf_events} == {"metric", "fellow"}
    seqs = [e["seq"] for e in mf_events]
    assert seqs == sorted(seqs)
    # A type that names no events is a mistake (a typo would otherwise be a silent stream).
    for params in ({"types": "bogus"}, {"types": "job,metrc"}):
        err = await expect_error(await api.get(f"{A}/events", params=params, headers=AUTH),
                                 400, "invalid_param", "types")
        assert "expected fellow, job, metric" in err["message"]
    await expect_error(await api.get(f"{A}/events", params={"job_id": "job-999999"},
                                     headers=AUTH), 404, "unknown_job")


async def test_events_client_close_is_prompt(api):
    hub = api.app[STATE_KEY].hub
    ws = await api.ws_connect(f"{A}/events", headers=AUTH)
    assert orjson.loads(await ws.receive_bytes(timeout=2))["type"] == "hello"
    assert hub.subscriber_count == 1
    t0 = time.monotonic()
    await ws.close()
    assert time.monotonic() - t0 < 2.0
    # The leader drops the subscriber at once, not at the next event.

    async def gone() -> bool:
        return hub.subscriber_count == 0

    await wait_for(gone, timeout=2.0)


async def test_events_closed_on_shutdown(make_api):
    api = await make_api()
    ws = await api.ws_connect(f"{A}/events", headers=AUTH)
    assert orjson.loads(await ws.receive_bytes(timeout=2))["type"] == "hello"
    t0 = time.monotonic()
    await api.server.close()
    msg = await ws.receive(timeout=5)
    assert msg.type.name in ("CLOSE", "CLOSING", "CLOSED")
    assert time.monotonic() - t0 < 5
    await ws.close()


def test_every_route_has_a_test():
    """Guard: a new route in ROUTES must be added to this file."""
    covered = {
        ("GET", "/healthz"), ("GET", f"{A}/info"), ("GET", f"{A}/openapi.json"),
        ("POST", f"{A}/fellows/register"), ("GET", f"{A}/fellows"),
        ("POST", f"{A}/fellows/release"), ("GET", f"{A}/fellows/{{fellow_id}}"),
        ("DELETE", f"{A}/fellows/{{fellow_id}}"),
        ("POST", f"{A}/fellows/{{fellow_id}}/heartbeat"),
        ("GET", f"{A}/fellows/{{fellow_id}}/signals"),
        ("POST", f"{A}/fellows/{{fellow_id}}/speed"), ("GET", f"{A}/nodes"),
        ("GET", f"{A}/fellows/{{fellow_id}}/log"),  # tests/unit/test_fellow_log.py
        ("POST", f"{A}/fellows/{{fellow_id}}/log"),  # tests/unit/test_fellow_log.py
        ("POST", f"{A}/jobs"), ("GET", f"{A}/jobs"), ("GET", f"{A}/jobs/{{job_id}}"),
        ("POST", f"{A}/jobs/{{job_id}}/cancel"), ("POST", f"{A}/jobs/{{job_id}}/status"),
        ("GET", f"{A}/events"),
        ("POST", f"{A}/jobs/{{job_id}}/shards/{{stage}}"),  # tests/unit/test_shards.py
        ("GET", f"{A}/jobs/{{job_id}}/progress"),  # tests/unit/test_progress.py
        ("GET", f"{A}/jobs/{{job_id}}/checkpoints/{{step}}/{{stage}}/{{part}}"),  # test_resume
        # tests/unit/test_shards.py
        ("GET", f"{A}/jobs/{{job_id}}/checkpoints/{{step}}/{{stage}}/replicas/{{replica}}/"
                "{part}"),
        ("GET", f"{A}/jobs/{{job_id}}/export"),  # tests/unit/test_shards.py
        ("GET", f"{A}/jobs/{{job_id}}/export/{{stage}}/{{part}}"),  # tests/unit/test_shards.py
        ("POST", f"{A}/jobs/{{job_id}}/regroup"),
        ("POST", f"{A}/jobs/{{job_id}}/statuses"),  # tests/unit/test_progress.py
    }
    assert {(r.method, r.path) for r in ROUTES} == covered


async def test_a_link_set_speed_on_a_torch_transport_job_is_refused_a_slowdown_is_not(api):
    """gloo's sockets are not the app's: a link setting on a fellow whose running job uses
    the torch transport would change nothing, so it is refused (409, named) and recorded
    nowhere; the fellow's emulated slowdown still applies."""
    jid, by_replica = await replicated_job(api, 7400, transport="torch")
    fellow = by_replica[1]["fellow_id"]
    refused = await api.post(f"{A}/fellows/{fellow}/speed", json={"tx_mbps": 8},
                             headers=AUTH)
    assert refused.status == 409
    err = (await refused.json())["error"]
    assert err["code"] == "unshaped_transport" and "torch transport" in err["message"]
    await expect_ok(await api.post(f"{A}/fellows/{fellow}/speed", json={"slowdown": 2.0},
                                   headers=AUTH), 202)
    changes = (await get_job(api, jid))["link_changes"]
    assert [(c["fellow_id"], c.get("link"), c["slowdown"]) for c in changes] == [
        (fellow, None, 2.0)]


async def _regroup(api: TestClient, job_id: str, reg: dict[str, Any], replica: int,
                   wait: float = 0.0, **extra: Any):
    body = {"fellow_id": reg["fellow_id"], "stage": 0, "replica": replica, **extra}
    return await api.post(f"{A}/jobs/{job_id}/regroup", json=body, params={"wait": str(wait)},
                          headers=reg["headers"])


async def test_a_lost_replica_leaves_once_the_survivors_regroup(api):
    """Three replicas of one stage: replica 2's cell fails; the two survivors report their
    broken ring at the same step, neither having committed it. The first is told to ask again
    (the second is not in yet); the second's report decides the round: both go on as members
    [0, 1] and do the step again. A survivor that asks again gets the same answer; the job
    runs on, records the change, the step's record has it, and the fellow that left is free."""
    jid, by_replica = await replicated_job(api, 7000)
    # Not a member of the job, or a membership that is over: refused, nothing changes.
    outsider = await register(api, "x", data_addr="127.0.0.1:7100")
    assert (await _regroup(api, jid, outsider, 0)).status == 409
    assert (await _regroup(api, jid, by_replica[0], 0, epoch=3)).status == 409
    resp = await report(api, jid, by_replica[2], "FAILED", step=4, stage=0, replica=2,
                        message="LinkClosed: link to stage 0 replica 1 closed")
    assert resp.status == 200, await resp.text()
    assert (await get_job(api, jid))["state"] == "RUNNING"  # (no recovery, no failure)
    first = await expect_ok(await _regroup(api, jid, by_replica[0], 0, op_step=5,
                                           synced_step=3))
    assert first["order"] is None
    second = await expect_ok(await _regroup(api, jid, by_replica[1], 1, wait=2.0, op_step=5,
                                            synced_step=3, finished=True))
    order = {"epoch": 1, "members": [0, 1], "commit": False, "drop": False, "donor": None,
             "redo_step": None}
    assert second["order"] == order
    again = await expect_ok(await _regroup(api, jid, by_replica[0], 0, op_step=5,
                                           synced_step=3))
    assert again["order"] == order
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING" and job["members"] == [0, 1]
    [change] = job["membership"]
    assert (change["step"], change["left"], change["members"]) == (6, [2], [0, 1])
    assert "LinkClosed" in change["reason"]
    records = (await expect_ok(await api.get(f"{A}/jobs/{jid}/progress", headers=AUTH)))
    assert [r["membership"][0]["left"] for r in records["records"] if r.get("membership")] \
        == [[2]]
    assert (await get_fellow(api, by_replica[2]["fellow_id"]))["current_job"] is None


SWARM_MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 8}


async def _swarm_job_of_three(api, port: int) -> tuple[str, dict[int, dict[str, Any]]]:
    """A swarm-wired job of one stage and three replicas on three fellows: its id, and each
    replica's fellow."""
    fellows = [await register(api, f"f{i}", data_addr=f"127.0.0.1:{port + i}")
               for i in range(3)]
    body = {"name": "r", "kind": "train", "model": SWARM_MODEL,
            "training": {"steps": 50, "batch_size": 6, "micro_batches": 1},
            "topology": {"stages": 1, "replicas": 3, "wiring": "swarm"}}
    jid = (await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201))["job_id"]
    job = await get_job(api, jid)
    return jid, {c["replica"]: next(f for f in fellows if f["fellow_id"] == c["fellow_id"])
                 for c in job["placement"]["stages"]}


async def _redo_step_6(api, jid: str, by_replica: dict[int, dict[str, Any]]) -> None:
    """Replica 2 dies in 0-based step 5 and the survivors, replica 0 having applied it, are
    told to train it again (the change at step 6: six steps done)."""
    await report(api, jid, by_replica[2], "FAILED", step=5, stage=0, replica=2,
                 message="LinkClosed: link to stage 0 replica 1 closed")
    await _regroup(api, jid, by_replica[0], 0, op_step=6, routed=True)
    answer = await expect_ok(await _regroup(api, jid, by_replica[1], 1, wait=2.0,
                                            op_step=5, routed=True))
    assert answer["order"]["redo_step"] == 5


async def test_a_routed_redo_drops_the_checkpoints_it_undid(api, leader_config):
    """Swarm wiring: the survivors train 0-based step 5 again. A checkpoint taken after it
    (step-6: six steps done) holds a state they undid, so it is gone and a resume takes the
    newest before it (step-5, five steps done, stays), and the export no longer names it; a
    push of one that was on its way as the change came is refused (409 checkpoint_undone),
    and nothing of it is kept."""
    import aiohttp

    from swarm_core.leader.uploads import complete_checkpoints

    jid, by_replica = await _swarm_job_of_three(api, 7450)
    runs = leader_config.state_dir / "runs"
    lead = by_replica[0]
    # Replica 2's shard of step 6 (six steps done), pushed whole: the job's export.
    await expect_ok(await api.post(f"{A}/jobs/{jid}/shards/0", data=_whole_shard(
        jid, SWARM_MODEL, by_replica[2]["fellow_id"], 2, 6), headers=by_replica[2]["headers"]),
        201)
    export = await expect_ok(await api.get(f"{A}/jobs/{jid}/export", headers=AUTH))
    assert [(s["stage"], s["step"]) for s in export["shards"]] == [(0, 6)]
    for step in (4, 5):  # (a stage's checkpoint is complete with its manifest)
        d = runs / jid / "checkpoints" / f"step-{step}" / "stage-0"
        d.mkdir(parents=True)
        (d / "shard_manifest.json").write_text(orjson.dumps(_manifest(jid, step)).decode())
    assert complete_checkpoints(runs, jid, 1) == [6, 5, 4]
    # Replica 0's push of step 6 begins (its body held back) before the change.
    with aiohttp.MultipartWriter("form-data") as mp:
        part = mp.append(orjson.dumps({**_manifest(jid, 6), "fellow_id": lead["fellow_id"]}),
                         {"Content-Type": "application/json"})
        part.set_content_disposition("form-data", name="manifest")
    body = bytearray()

    class _Sink:
        async def write(self, chunk: bytes) -> None:
            body.extend(chunk)

    await mp.write(_Sink())
    go = asyncio.Event()

    async def held_back():
        yield bytes(body[:10])
        await go.wait()
        yield bytes(body[10:])

    push = asyncio.ensure_future(api.post(
        f"{A}/jobs/{jid}/shards/0", data=held_back(), headers={
            **lead["headers"], "Content-Type": f"multipart/form-data; boundary={mp.boundary}"}))
    await asyncio.sleep(0.2)
    await _redo_step_6(api, jid, by_replica)
    assert complete_checkpoints(runs, jid, 1) == [5, 4]
    [change] = (await get_job(api, jid))["membership"]
    assert change["step"] == 6
    go.set()
    refused = await push
    assert refused.status == 409, await refused.text()
    assert (await refused.json())["error"]["code"] == "checkpoint_undone"
    assert complete_checkpoints(runs, jid, 1) == [5, 4]
    # (nor does the export point at the undone weights: the stage has none until its next push)
    export = await expect_ok(await api.get(f"{A}/jobs/{jid}/export", headers=AUTH))
    assert export["shards"] == [] and export["step"] is None
    # (renamed out of view as the change came, its files removed off the leader's loop)
    root = runs / jid / "checkpoints"
    for _ in range(100):
        if sorted(p.name for p in root.iterdir()) == ["step-4", "step-5"]:
            break
        await asyncio.sleep(0.05)
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-5"]


def _whole_shard(job_id: str, model: dict[str, Any], fellow_id: int, replica: int,
                 step: int) -> Any:
    """A one-stage job's shard at ``step`` as a fellow pushes it: manifest and weights."""
    import aiohttp

    from swarm_core.artifacts.shards import build_manifest, npz_bytes, state_arrays
    from swarm_core.config.schemas import ModelConfig
    from swarm_core.pipeline.model import StageModule

    arrays = state_arrays(StageModule(ModelConfig(**model), 256, 0, 0, 1, 0, 1))
    weights = npz_bytes(arrays)
    manifest = build_manifest(job_id=job_id, stage=0, num_stages=1, fellow_id=fellow_id,
                              fellow_name=f"f{fellow_id}", layers=(0, 1), step=step,
                              model=model, seed=0, vocab_size=256,
                              tokenizer={"name": "byte"}, arrays=arrays, weights=weights,
                              replica=replica)
    whole = aiohttp.MultipartWriter("form-data")
    for name, part in (("manifest", orjson.dumps(manifest)), ("weights", weights)):
        whole.append(part).set_content_disposition("form-data", name=name)
    return whole


async def test_a_push_published_as_a_redo_undoes_its_step_is_withdrawn(api, monkeypatch):
    """A swarm-wired push whose publish is under way when the survivors are told to train
    its step again: its files are the fellow's shard now, of weights they undid, so it is
    refused (409 checkpoint_undone) and the export names no shard of that fellow's (its
    step-4 receipt named the files the push replaced); a push of a step before the redo's
    is taken after it."""
    import threading

    from swarm_core.leader import uploads

    jid, by_replica = await _swarm_job_of_three(api, 7460)
    lead = by_replica[0]
    await expect_ok(await api.post(f"{A}/jobs/{jid}/shards/0", data=_whole_shard(
        jid, SWARM_MODEL, lead["fellow_id"], 0, 4), headers=lead["headers"]), 201)
    published, go = threading.Event(), threading.Event()
    real = uploads.publish

    def held(*args: Any) -> Any:
        out = real(*args)
        published.set()
        go.wait(10)  # (the redo is decided while the publish's thread is still out)
        return out

    monkeypatch.setattr(uploads, "publish", held)
    push = asyncio.ensure_future(api.post(f"{A}/jobs/{jid}/shards/0", data=_whole_shard(
        jid, SWARM_MODEL, lead["fellow_id"], 0, 6), headers=lead["headers"]))
    for _ in range(200):
        if published.is_set():
            break
        await asyncio.sleep(0.02)
    assert published.is_set()
    await _redo_step_6(api, jid, by_replica)
    go.set()
    refused = await push
    assert refused.status == 409, await refused.text()
    assert (await refused.json())["error"]["code"] == "checkpoint_undone"
    export = await expect_ok(await api.get(f"{A}/jobs/{jid}/export", headers=AUTH))
    assert export["shards"] == [], export["shards"]
    # (a shard of a step before the redo's is the export's again)
    monkeypatch.setattr(uploads, "publish", real)
    await expect_ok(await api.post(f"{A}/jobs/{jid}/shards/0", data=_whole_shard(
        jid, SWARM_MODEL, lead["fellow_id"], 0, 5), headers=lead["headers"]), 201)
    export = await expect_ok(await api.get(f"{A}/jobs/{jid}/export", headers=AUTH))
    assert [(x["stage"], x["step"]) for x in export["shards"]] == [(0, 5)]


def _manifest(job_id: str, step: int) -> dict[str, Any]:
    """A stage shard's manifest as a push leaves it (the fields a checkpoint is read by)."""
    return {"job_id": job_id, "stage": 0, "num_stages": 1, "fellow_id": 0, "step": step,
            "config_fingerprint": "f", "layers": {"start": 0, "stop": 1}, "model": {},
            "vocab_size": 256, "seed": 0, "weights_sha256": "ab" * 32}


async def test_a_replica_that_left_counts_in_none_of_the_jobs_figures(api):
    """A job of three replicas whose replica 2 left: its last figures stay in its cell's
    metrics, but the job's tokens/s sums the members' only, and its final loss is the last
    step's (the members' mean), not a mean with the departed replica's stale figures."""
    jid, by_replica = await replicated_job(api, 7050)

    async def step(replica: int, n: int, loss: float, state: str = "RUNNING", **figures):
        resp = await report(api, jid, by_replica[replica], state, step=n, stage=0,
                            replica=replica, loss=loss, tokens_per_s=100.0,
                            metrics={"wire_tx_bytes": 10, "step_seconds": 0.1, **figures})
        assert resp.status == 200, await resp.text()

    for r in range(3):
        await step(r, 4, 3.0 + r)
    assert (await get_job(api, jid))["metrics"]["tokens_per_s"] == 300.0
    await step(2, 4, 9.0, "FAILED")
    await _regroup(api, jid, by_replica[0], 0, op_step=5, synced_step=4)
    await expect_ok(await _regroup(api, jid, by_replica[1], 1, wait=2.0, op_step=5,
                                   synced_step=4))
    assert (await get_job(api, jid))["members"] == [0, 1]
    for r in (0, 1):
        await step(r, 50, 2.0 + r)
    for r in (0, 1):
        await step(r, 50, 2.0 + r, "COMPLETED", steps=50, final_loss=2.0 + r)
    job = await get_job(api, jid)
    assert job["state"] == "COMPLETED"
    assert job["metrics"]["tokens_per_s"] == 200.0
    assert job["metrics"]["final_loss"] == 2.5
    assert job["metrics"]["stages"]["0.2"]["tokens_per_s"] == 100.0  # (its cell's, kept)


async def test_a_ready_fellow_joins_as_the_replica_that_left(api):
    """After replica 1 of three left, a fellow that registers joins as replica 1 (not the
    one whose cell failed: it is up, but what failed may fail again): its START names the
    membership it joins and the donor (the first member); each member is told the new
    membership and where the joiner listens; its first step's report records the join."""
    jid, by_replica = await replicated_job(api, 7200,
                                            sync={"mode": "diloco", "inner_steps": 5})
    for f in by_replica.values():
        await poll(api, f)  # (their STARTs)
    assert (await report(api, jid, by_replica[1], "FAILED", step=4, stage=0,
                         replica=1, message="killed")).status == 200
    for r in (0, 2):
        assert (await _regroup(api, jid, by_replica[r], r, op_step=4, synced_step=-1)).status \
            == 200
    assert (await get_job(api, jid))["members"] == [0, 2]
    await asyncio.sleep(0.3)  # (ticks go by: the fellow that failed is not taken back)
    assert [s for s in await poll(api, by_replica[1], after=1) if s["kind"] == "START"] == []
    spare = await register(api, "spare", data_addr="127.0.0.1:7300")
    async def join_start():
        return [s for s in await poll(api, spare) if s["kind"] == "START"]

    [start] = await wait_for(join_start)
    assert start["kind"] == "START" and start["payload"]["replica"] == 1
    assert start["payload"]["join"] == {"epoch": 2, "members": [0, 1, 2], "commit": False,
                                        "drop": False, "donor": 0,
                                        "redo_step": None}
    for r in (0, 2):
        signals = await poll(api, by_replica[r], after=1)
        [told] = [s for s in signals if s["kind"] == "MEMBERS"]
        assert told["payload"]["order"] == start["payload"]["join"]
        assert (told["payload"]["stage"], told["payload"]["replica"]) == (0, r)
        cell = next(c for c in told["payload"]["placement"]["stages"] if c["replica"] == 1)
        assert (cell["fellow_id"], cell["data_addr"]) == (spare["fellow_id"], "127.0.0.1:7300")
    job = await get_job(api, jid)
    assert job["members"] == [0, 2]  # (until the group has taken it in)
    assert (await report(api, jid, spare, "RUNNING", step=11, stage=0, replica=1,
                         loss=2.0)).status == 200
    job = await get_job(api, jid)
    assert job["members"] == [0, 1, 2]
    left, joined = job["membership"]
    assert left["left"] == [1]
    assert (joined["step"], joined["joined"], joined["members"]) == (11, [1], [0, 1, 2])
    assert f"fellow {spare['fellow_id']} joined" in joined["reason"]


@pytest.mark.parametrize("taken_in", [False, True])
async def test_a_group_that_finishes_without_its_joiner_completes_the_job(api, taken_in):
    """Issue 40: a spare told to join as the group reaches its last step. Where the members
    complete under the membership before the join's, it was never taken in: the join is off,
    the spare stopped, and the job completes on their reports (it waited for the spare's
    cell, then failed idle). Where they complete under the join's, the spare trained with
    them: the job waits for its report, which records the join."""
    jid, by_replica = await replicated_job(api, 7400,
                                            sync={"mode": "diloco", "inner_steps": 5})
    assert (await report(api, jid, by_replica[1], "FAILED", step=4, stage=0,
                         replica=1, message="killed")).status == 200
    for r in (0, 2):
        assert (await _regroup(api, jid, by_replica[r], r, op_step=4, synced_step=-1)).status \
            == 200
    spare = await register(api, "spare", data_addr="127.0.0.1:7500")
    [start] = await wait_for(lambda: _signals(api, spare, "START"))
    epoch = start["payload"]["join"]["epoch"] if taken_in else 1
    for r in (0, 2):
        assert (await report(api, jid, by_replica[r], "COMPLETED", step=50, stage=0,
                             replica=r, epoch=epoch)).status == 200
    job = await get_job(api, jid)
    if not taken_in:
        assert job["state"] == "COMPLETED", job["reason"]
        assert "1 replica(s) left" in job["reason"]
        assert [c["left"] for c in job["membership"]] == [[1]]  # (no join recorded)
        [stop] = await _signals(api, spare, "STOP")
        assert "without taking it in" in stop["payload"]["reason"]
        return
    assert job["state"] == "RUNNING" and await _signals(api, spare, "STOP") == []
    assert (await report(api, jid, spare, "COMPLETED", step=50, stage=0, replica=1,
                         epoch=epoch)).status == 200
    job = await get_job(api, jid)
    assert job["state"] == "COMPLETED" and job["members"] == [0, 1, 2]
    assert [c["joined"] for c in job["membership"]] == [[], [1]]


async def _signals(api: TestClient, reg: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [s for s in await poll(api, reg) if s["kind"] == kind]


async def test_a_leader_restarted_during_a_join_tells_the_members_again(aiohttp_client,
                                                                        leader_config):
    """Issue 36, point 7: the leader dies after telling a spare to join and before the
    members polled their MEMBERS signal (queued in the old leader's memory). Restarted, it
    knows the join (stored with the job) and tells each member again, so the group rings the
    joiner instead of leaving it waiting out its ring deadline; the spare's first report
    records the join, once."""
    api = await aiohttp_client(create_app(leader_config))
    jid, by_replica = await replicated_job(api, 7250,
                                            sync={"mode": "diloco", "inner_steps": 5})
    for f in by_replica.values():
        await poll(api, f)  # (their STARTs)
    assert (await report(api, jid, by_replica[1], "FAILED", step=4, stage=0,
                         replica=1, message="killed")).status == 200
    for r in (0, 2):
        assert (await _regroup(api, jid, by_replica[r], r, op_step=4, synced_step=-1)).status \
            == 200
    spare = await register(api, "spare", data_addr="127.0.0.1:7350")

    async def join_start():
        return [s for s in await poll(api, spare) if s["kind"] == "START"]

    [start] = await wait_for(join_start)
    order = start["payload"]["join"]
    assert order["epoch"] == 2 and order["members"] == [0, 1, 2]
    # (the members never poll before the leader dies: their MEMBERS die with it)
    await api.close()
    api = await aiohttp_client(create_app(leader_config))
    regs = {r: await register(api, **by_replica[r]["body"]) for r in (0, 2)}
    spare = await register(api, **spare["body"])
    for r in (0, 2):
        signals = await poll(api, regs[r])  # (a new leader numbers its signals from 1)
        [told] = [s for s in signals if s["kind"] == "MEMBERS"]
        assert told["payload"]["order"] == order
    assert (await get_job(api, jid))["members"] == [0, 2]  # (until the group takes it in)
    assert (await report(api, jid, spare, "RUNNING", step=11, stage=0, replica=1,
                         loss=2.0)).status == 200
    job = await get_job(api, jid)
    assert job["members"] == [0, 1, 2]
    left, joined = job["membership"]
    assert (left["left"], joined["step"], joined["joined"]) == ([1], 11, [1])
    # Taken in, the join is no longer stored: another restart does not tell anyone again.
    await api.close()
    api = await aiohttp_client(create_app(leader_config))
    regs = {r: await register(api, **by_replica[r]["body"]) for r in (0, 2)}
    for r in (0, 2):
        assert [s for s in await poll(api, regs[r]) if s["kind"] == "MEMBERS"] == []


async def test_a_member_that_closed_its_ring_link_is_lost_after_a_heartbeat(api, leader_config):
    """Replica 1 of three died (a process that ends closes its sockets): replica 2 saw the
    link from it close. With both survivors in, the round does not wait out the heartbeat
    timeout for replica 1's silence: a heartbeat interval later it is decided without it."""
    jid, by_replica = await replicated_job(api, 7400)
    t0 = time.monotonic()
    assert (await expect_ok(await _regroup(api, jid, by_replica[0], 0, op_step=3,
                                           synced_step=2)))["order"] is None
    answer = await expect_ok(await _regroup(api, jid, by_replica[2], 2, wait=4.0, op_step=3,
                                            synced_step=2, closed_by=1))
    assert answer["order"]["members"] == [0, 2]
    assert time.monotonic() - t0 < leader_config.stale_after_s  # (not the timeout's wait)
    [change] = (await get_job(api, jid))["membership"]
    assert change["left"] == [1]
    assert f"fellow {by_replica[1]['fellow_id']} (stage 0 replica 1) closed its link" \
        in change["reason"]


async def test_a_job_left_with_no_replica_ends_as_a_chain_would(api):
    """Every replica's cell fails: there is no one to train on, so the job ends as a job of
    one replica does under its resume policy (here: fail), naming the last failure."""
    jid, by_replica = await replicated_job(api, 7500)
    for r in (2, 1):
        assert (await report(api, jid, by_replica[r], "FAILED", step=4, stage=0, replica=r,
                             message=f"boom {r}")).status == 200
        assert (await get_job(api, jid))["state"] == "RUNNING"  # (replica 0 trains on)
    assert (await report(api, jid, by_replica[0], "FAILED", step=4, stage=0, replica=0,
                         message="boom 0")).status == 200
    job = await get_job(api, jid)
    assert job["state"] == "FAILED" and "boom 0" in job["reason"]
    assert job["restarts"] == []


async def test_a_silent_member_still_at_work_is_waited_for_past_the_timeout(api, monkeypatch):
    """DiLoCo: replica 2 failed, replica 0 reported its broken ring, replica 1 is training
    inner steps and has not reached its next outer step. Its fellow heartbeats and says it
    runs the cell, so the heartbeat timeout passing does not make it lost: the round waits,
    and is decided with it once it reports."""
    import swarm_core.leader.membership as membership

    jid, by_replica = await replicated_job(api, 7600,
                                            sync={"mode": "diloco", "inner_steps": 50})
    job = await get_job(api, jid)
    for r, f in by_replica.items():
        await heartbeat(api, f, status="busy", running=[
            {"job_id": jid, "stage": 0, "replica": r, "attempt": job["attempt"]}])
    assert (await report(api, jid, by_replica[2], "FAILED", step=7, stage=0, replica=2,
                         message="boom")).status == 200
    first = await expect_ok(await _regroup(api, jid, by_replica[0], 0, op_step=49,
                                           synced_step=-1))
    assert first["order"] is None
    real = time.monotonic

    class Later:  # the membership's clock, a minute on: past the heartbeat timeout
        @staticmethod
        def monotonic() -> float:
            return real() + 60.0

        time = staticmethod(time.time)

    monkeypatch.setattr(membership, "time", Later)
    await heartbeat(api, by_replica[1], status="busy", running=[
        {"job_id": jid, "stage": 0, "replica": 1, "attempt": job["attempt"]}])
    await asyncio.sleep(0.3)  # (ticks go by)
    assert (await get_job(api, jid))["members"] is None  # (undecided: replica 1 is at work)
    again = await expect_ok(await _regroup(api, jid, by_replica[0], 0, op_step=49,
                                           synced_step=-1))
    assert again["order"] is None
    late = await expect_ok(await _regroup(api, jid, by_replica[1], 1, op_step=49,
                                          synced_step=-1))
    assert late["order"]["members"] == [0, 1]


@pytest.mark.parametrize("restart", [False, True], ids=["leader-up", "leader-restarted"])
async def test_a_cell_held_up_behind_its_chain_does_not_hold_the_round(
        aiohttp_client, leader_config, restart):
    """Two stages, two replicas; replica 1's stage-1 cell fails. Replica 0's stage-1 cell
    asks at once; its stage-0 cell is held up behind it (its group had finished the step's
    all-reduce; it waits for the global norm) and only asks at its next synchronisation.
    Who goes on is decided without it, stage 1's group gets its order; the held-up cell
    then asks under the old membership and gets stage 0's. The change records by stage the
    first step each group trained without replica 1 (stage 0 kept the step it had
    finished). With the leader restarted between the two, the decided round is kept with
    the job: stage 0 gets the same order (not a new round that stage 1, training on under
    membership 1, would never join) and the change is recorded once."""
    api = await aiohttp_client(create_app(leader_config))
    jid, job, cell = await grid_job(api, 7700)
    assert (await report(api, jid, cell[(1, 1)], "FAILED", step=6, stage=1, replica=1,
                         message="killed")).status == 200
    await heartbeat(api, cell[(0, 0)], status="busy", running=[
        {"job_id": jid, "stage": 0, "replica": 0, "attempt": job["attempt"]}])

    async def ask(stage: int, op_step: int, synced_step: int, wait: float = 0.0):
        body = {"fellow_id": cell[(stage, 0)]["fellow_id"], "stage": stage, "replica": 0,
                "op_step": op_step, "synced_step": synced_step}
        return await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup", json=body,
                                              params={"wait": str(wait)},
                                              headers=cell[(stage, 0)]["headers"]))

    first = await ask(1, op_step=6, synced_step=5, wait=3.0)
    assert first["order"] == {"epoch": 1, "members": [0], "commit": False, "drop": False,
                              "donor": None, "redo_step": None}
    assert (await get_job(api, jid))["membership"] == []  # (stage 0's group is yet to ask)
    if restart:
        await api.close()
        api = await aiohttp_client(create_app(leader_config))
        for (s, r), reg in list(cell.items()):  # (the same processes: sessions are per leader)
            cell[(s, r)] = await register(api, **reg["body"])
    held = await ask(0, op_step=7, synced_step=6)
    assert held["order"] == first["order"]
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING" and job["members"] == [0]
    [change] = job["membership"]
    assert (change["step"], change["stage_steps"], change["left"]) == (7, [8, 7], [1])
    assert "killed" in change["reason"]
    if restart:  # (and the round is done: nothing of it is kept)
        await api.close()
        api = await aiohttp_client(create_app(leader_config))
        job = await get_job(api, jid)
        assert job["members"] == [0] and len(job["membership"]) == 1


async def test_a_replica_lost_through_a_broken_link_is_blamed_on_the_fellow_that_left(api):
    """Two stages, two replicas; replica 1's stage-1 fellow dies. Its stage-0 neighbour,
    which is up, reports FAILED blaming the link to stage 1: the change records replica 1 as
    left because of the stage-1 fellow, not of the survivor that reported it."""
    jid, job, cell = await grid_job(api, 7720)
    survivor, dead = cell[(0, 1)], cell[(1, 1)]
    assert (await report(api, jid, survivor, "FAILED", step=6, stage=0, replica=1,
                         blames_stage=1, message="LinkClosed: stage 1 closed the link")
            ).status == 200
    for stage in (1, 0):
        body = {"fellow_id": cell[(stage, 0)]["fellow_id"], "stage": stage, "replica": 0,
                "op_step": 6, "synced_step": 5}
        await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup", json=body,
                                       params={"wait": "0"}, headers=cell[(stage, 0)]["headers"]))
    job = await get_job(api, jid)
    [change] = job["membership"]
    assert change["left"] == [1]
    assert change["reason"].startswith(f"fellow {dead['fellow_id']} (f{dead['fellow_id']}, "
                                       "stage 1 replica 1) dropped out at step 6"), change
    assert f"its neighbour fellow {survivor['fellow_id']}" in change["reason"]


async def test_a_group_whose_ring_held_through_a_regroup_nobody_left_may_regroup_later(api):
    """Two stages, two replicas, every cell alive. Stage 1's ring times out: both its cells
    ask, stage 0's are held up behind them; nobody left, so only stage 1's group moves to
    membership 1. Later stage 0's ring breaks; its cells ask under membership 0, which had
    the members there are now: they are heard (not refused as over) and ordered into
    membership 2."""
    jid, job, cell = await grid_job(api, 7710)

    async def at_work(stage: int) -> None:
        for r in (0, 1):
            await heartbeat(api, cell[(stage, r)], status="busy", running=[
                {"job_id": jid, "stage": stage, "replica": r, "attempt": job["attempt"]}])

    async def ask(stage: int, replica: int, epoch: int, op_step: int):
        body = {"fellow_id": cell[(stage, replica)]["fellow_id"], "stage": stage,
                "replica": replica, "epoch": epoch, "op_step": op_step,
                "synced_step": op_step - 1}
        return await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup", json=body,
                                              headers=cell[(stage, replica)]["headers"]))

    for r in (0, 1):
        assert (await ask(1, r, 0, 6))["order"] is None  # (stage 0's cells not yet heard of)
    await at_work(0)
    order = (await ask(1, 0, 0, 6))["order"]
    assert order == {"epoch": 1, "members": [0, 1], "commit": False, "drop": False,
                     "donor": None, "redo_step": None}
    job = await get_job(api, jid)
    assert job["members"] == [0, 1]
    assert [(c["epoch"], c["left"], c["joined"], c["stage_steps"])
            for c in job["membership"]] == [(1, [], [], [7, 7])]
    for r in (0, 1):
        assert (await ask(0, r, 0, 12))["order"] is None
    await at_work(1)
    order = (await ask(0, 0, 0, 12))["order"]
    assert order == {"epoch": 2, "members": [0, 1], "commit": False, "drop": False,
                     "donor": None, "redo_step": None}
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING" and job["members"] == [0, 1]
    assert [c["epoch"] for c in job["membership"]] == [1, 2]
