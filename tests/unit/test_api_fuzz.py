"""Hypothesis: no request body (or path / query value) makes the leader answer 5xx, and
``swarm_core.schema.structure`` either builds the class or raises SchemaError, nothing else.

pytest-aiohttp fixtures do not mix with ``@given`` on async tests, so each test here is a plain
synchronous ``@given`` test that drives a real leader (aiohttp TestServer on loopback) through its
own event loop; the leader lives for the whole test, across all of its examples.
"""

from __future__ import annotations

import asyncio
import math
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from swarm_core import protocol
from swarm_core.contract import Heartbeat, JobStatusUpdate, JobSubmit
from swarm_core.contract import heartbeat as contract_heartbeat
from swarm_core.contract import job as contract_job
from swarm_core.contract import metrics as contract_metrics
from swarm_core.contract import placement as contract_placement
from swarm_core.contract import start as contract_start
from swarm_core.leader import LeaderConfig, create_app
from swarm_core.leader.keys import STATE_KEY
from swarm_core.leader.records import JobRecord
from swarm_core.leader.state import LeaderState
from swarm_core.protocol import SESSION_HEADER, RegisterRequest, ReleaseRequest, SetSpeedRequest
from swarm_core.schema import SchemaError, structure
from tests.support import AUTH, TOKEN

A = "/api/v1"
MAX_INT = 2**63 - 1  # orjson refuses to write ints beyond 64 bits

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


# --- strategies ---------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-MAX_INT, MAX_INT), st.integers(-3, 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=16,
)
# For calling ``structure`` directly: also what JSON cannot carry.
py_scalars = json_scalars | st.integers() | st.sampled_from([math.nan, math.inf, -math.inf])
py_values = st.recursive(
    py_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=16,
)

# Strings that pass the validators some of the time.
_HINTED_STRINGS = ["cpu", "cuda:0", "cuda:x", "ready", "busy", "released", "RUNNING",
                   "COMPLETED", "FAILED", "smoke", "train", "job-000001", "127.0.0.1:1", ""]
_WORDS = st.text(st.characters(categories=["L", "N", "Pd"]), min_size=1, max_size=12)


def typed(tp: Any, anything: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Values of roughly the right type for a field, mixed with ``anything``.

    With ``anything=st.nothing()`` the values are well typed and mostly valid, so that the
    happy paths behind the structuring get exercised too.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    clean = anything.is_empty
    if tp is Any:
        return json_values if clean else anything
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[typed(a, anything) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args) | anything
    if tp is type(None):
        return st.none()
    if origin is list:
        return st.lists(typed(args[0], anything), max_size=5) | anything
    if origin is dict or tp is dict:
        return st.dictionaries(st.text(max_size=8), anything | json_scalars, max_size=4) | anything
    if tp is bool:
        return st.booleans() | anything
    if tp is int:
        if clean:
            return st.integers(0, 8) | st.integers(-1, MAX_INT)
        return st.integers(-2, 8) | st.integers(-MAX_INT, MAX_INT) | anything
    if tp is float:
        if clean:
            return st.floats(0.001, 1e5) | st.integers(0, 70_000) | st.floats(-1e6, 1e6)
        return st.floats(-1e6, 1e6, allow_nan=False) | st.integers(-5, 70_000) | anything
    if tp is str:
        if clean:
            return st.sampled_from(_HINTED_STRINGS) | _WORDS
        return (st.sampled_from(_HINTED_STRINGS) | st.text(max_size=12)
                | st.text(min_size=120, max_size=140) | anything)
    if attrs.has(tp):
        return field_dicts(tp, anything)
    return anything


def field_dicts(cls: type, anything: st.SearchStrategy[Any] = json_values,
                **override: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects built from the real field names of ``cls``.

    Noisy (``anything`` mixed in): any subset of the fields, sometimes an extra key. Clean
    (``anything=st.nothing()``): required fields present, well-typed values, no extra key.
    """
    hints = typing.get_type_hints(cls)
    values = {f.name: override[f.name] if f.name in override else typed(hints[f.name], anything)
              for f in attrs.fields(cls)}
    if anything.is_empty:
        required = {f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING}
        return st.fixed_dictionaries(
            {k: v for k, v in values.items() if k in required},
            optional={k: v for k, v in values.items() if k not in required})
    base = st.fixed_dictionaries({}, optional=values)
    with_extra = st.builds(lambda d, k, v: {**d, k: v}, base, st.text(max_size=6), anything)
    return st.one_of(base, base, with_extra)


def bodies(cls: type, **override: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Any JSON value, an object shaped like ``cls`` (noisy or clean), or bytes, not JSON."""
    return st.one_of(json_values, field_dicts(cls, **override),
                     field_dicts(cls, st.nothing(), **override),
                     field_dicts(cls, st.nothing(), **override), st.binary(max_size=40))


# --- a leader on its own loop -------------------------------------------------------------------


class Leader:
    """A real leader app on a loopback TestServer, driven from synchronous tests."""

    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        cfg = LeaderConfig(state_dir=state_dir, token=TOKEN, stale_after_s=3600.0, tick_s=0.05)

        async def start() -> TestClient:
            client = TestClient(TestServer(create_app(cfg)))
            await client.start_server()
            return client

        self.client = self.run(start())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def state(self) -> LeaderState:
        return self.client.server.app[STATE_KEY]

    def close(self) -> None:
        self.run(self.client.close())
        self.loop.close()

    async def call(self, method: str, url: str, body: Any = None,
                   headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, Any]:
        """Send ``body`` (JSON-encoded unless bytes); assert a well-formed non-5xx reply."""
        if body is not None:
            kw["data"] = body if isinstance(body, bytes) else orjson.dumps(body)
        hdrs = {**AUTH, "Content-Type": "application/json", **(headers or {})}
        resp = await self.client.request(method, url, headers=hdrs, **kw)
        raw = await resp.read()
        assert resp.status < 500, (method, url, body, resp.status, raw[:500])
        payload = orjson.loads(raw)
        if resp.status < 300:
            assert resp.status >= 200 and isinstance(payload, dict) and "error" not in payload
        else:
            assert 400 <= resp.status < 500, resp.status
            err = payload["error"]
            assert set(err) <= {"code", "message", "field"}
            assert isinstance(err["code"], str) and err["code"]
            assert isinstance(err["message"], str) and err["message"]
            assert isinstance(err.get("field", ""), str)
        return resp.status, payload

    async def worker(self, name: str = "worker") -> dict[str, Any]:
        """(Re-)register a well-behaved fellow: same id every time, a fresh session, ready."""
        status, reg = await self.call("POST", f"{A}/fellows/register",
                                      {"name": name, "instance_id": f"{name}-1",
                                       "data_addr": "127.0.0.1:9"})
        assert status == 201, reg
        reg["headers"] = {SESSION_HEADER: reg["session"]}
        return reg

    async def flush_signals(self, reg: dict[str, Any]) -> list[dict[str, Any]]:
        """Poll (the batch must serialise) and acknowledge everything pending."""
        fid = reg["fellow_id"]
        status, batch = await self.call("GET", f"{A}/fellows/{fid}/signals",
                                        headers=reg["headers"])
        assert status == 200, batch
        if batch["signals"]:
            last = batch["signals"][-1]["seq"]
            await self.call("GET", f"{A}/fellows/{fid}/signals", headers=reg["headers"],
                            params={"after": str(last)})
        return batch["signals"]


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[Leader]:
    lead = Leader(tmp_path / "state")
    try:
        yield lead
    finally:
        lead.close()


# --- HTTP: request bodies -----------------------------------------------------------------------


@FUZZ
@given(body=bodies(RegisterRequest))
def test_register_never_5xx(leader: Leader, body: Any) -> None:
    async def go() -> None:
        status, reply = await leader.call("POST", f"{A}/fellows/register", body)
        event(f"HTTP {status}")
        if status == 201:
            assert isinstance(reply["fellow_id"], int) and reply["session"]
            # What was stored reads back, one by one and in the list.
            s, view = await leader.call("GET", f"{A}/fellows/{reply['fellow_id']}")
            assert s == 200 and view["name"] == body["name"]
            s, _ = await leader.call("GET", f"{A}/fellows")
            assert s == 200
        else:
            assert status in (400, 409), reply

    leader.run(go())


@FUZZ
@given(body=bodies(Heartbeat))
def test_heartbeat_never_5xx(leader: Leader, body: Any) -> None:
    async def go() -> None:
        w = await leader.worker()
        status, reply = await leader.call("POST", f"{A}/fellows/{w['fellow_id']}/heartbeat",
                                          body, w["headers"])
        event(f"HTTP {status}")
        assert status in (200, 400), reply
        if status == 200:
            assert isinstance(reply["pending_signals"], int)
        for url in (f"{A}/fellows/{w['fellow_id']}", f"{A}/fellows", f"{A}/nodes", f"{A}/info"):
            s, view = await leader.call("GET", url)
            assert s == 200, view

    leader.run(go())


@FUZZ
@given(body=bodies(SetSpeedRequest))
def test_set_speed_never_5xx(leader: Leader, body: Any) -> None:
    async def go() -> None:
        w = await leader.worker()
        status, reply = await leader.call("POST", f"{A}/fellows/{w['fellow_id']}/speed", body)
        event(f"HTTP {status}")
        # (a per-pair set-speed names a peer: none here has one, or is one, so 404 or 409)
        per_pair = isinstance(body, dict) and isinstance(body.get("to"), int)
        assert status in ((202, 400, 404, 409) if per_pair else (202, 400)), reply
        signals = await leader.flush_signals(w)
        assert [s["kind"] for s in signals] == (["SET_SPEED"] if status == 202 else [])

    leader.run(go())


@FUZZ
@given(body=bodies(ReleaseRequest, fellow_ids=st.lists(st.integers(-1, 4), max_size=4)
                   | st.lists(json_values, max_size=3)))
def test_release_never_5xx(leader: Leader, body: Any) -> None:
    async def go() -> None:
        a = await leader.worker("a")
        b = await leader.worker("b")
        status, reply = await leader.call("POST", f"{A}/fellows/release", body)
        event(f"HTTP {status}")
        assert status in (202, 400, 404), reply
        if status == 202:
            assert set(reply["released"]) <= {a["fellow_id"], b["fellow_id"]}
        for w in (a, b):
            await leader.flush_signals(w)

    leader.run(go())


@FUZZ
@given(body=bodies(JobSubmit, topology=st.fixed_dictionaries(
    {}, optional={"fellows": st.integers(-1, 3) | json_values}) | json_values))
def test_job_submit_never_5xx(leader: Leader, body: Any) -> None:
    async def go() -> None:
        w = await leader.worker()
        status, job = await leader.call("POST", f"{A}/jobs", body)
        event(f"HTTP {status}")
        assert status in (201, 400), job
        if status == 201:
            assert job["state"] in ("PENDING", "RUNNING")
            s, again = await leader.call("GET", f"{A}/jobs/{job['job_id']}")
            assert s == 200 and again["model"] == job["model"]
            # The START signal (which carries model and training) must reach the fellow.
            await leader.flush_signals(w)
            s, done = await leader.call("POST", f"{A}/jobs/{job['job_id']}/cancel")
            assert s == 200 and done["state"] == "CANCELLED"
            await leader.flush_signals(w)
        s, _ = await leader.call("GET", f"{A}/jobs")
        assert s == 200

    leader.run(go())


@FUZZ
@given(data=st.data())
def test_job_status_never_5xx(leader: Leader, data: st.DataObject) -> None:
    async def go() -> None:
        w = await leader.worker()
        s, running = await leader.call("GET", f"{A}/jobs", params={"state": "RUNNING"})
        assert s == 200
        if running["jobs"]:
            job_id = running["jobs"][0]["job_id"]
        else:
            s, job = await leader.call("POST", f"{A}/jobs", {"kind": "smoke"})
            assert s == 201 and job["state"] == "RUNNING", job
            job_id = job["job_id"]
        mine = st.just(w["fellow_id"])
        fellow_ids = st.one_of(mine, mine, mine, st.integers(-1, 3), json_values)
        body = data.draw(bodies(JobStatusUpdate, fellow_id=fellow_ids), label="body")
        target = data.draw(st.sampled_from([job_id, job_id, "job-999999", "x y"]), label="job")
        status, reply = await leader.call("POST", f"{A}/jobs/{quote(target, safe='')}/status",
                                          body, w["headers"])
        event(f"HTTP {status}")
        assert status in (200, 400, 403, 404, 409), reply
        s, view = await leader.call("GET", f"{A}/jobs/{job_id}")
        assert s == 200
        if status == 200 and body.get("attempt", 0) == view["attempt"]:
            # Reports from another attempt are ignored; this attempt's advance last_step.
            assert view["last_step"] >= body.get("step", 0)
        await leader.flush_signals(w)

    leader.run(go())


# Figures as a hostile or broken fellow might send them: at and past every bound, typed wrong.
_hostile_numbers = st.one_of(
    st.sampled_from([0, 1, -1, 2**44, 2**44 + 1, 2**62, 2**63 - 1, 2**64 - 1, 1e300, -1e300,
                     0.5, "x", None]),
    st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False, allow_infinity=False))
_extreme_counts = st.sampled_from([0, -1, 2**44, 2**44 + 1, 2**62, 2**63 - 1, 2**64 - 1])
_hostile_metrics = st.dictionaries(
    st.sampled_from([f.name for f in attrs.fields(contract_metrics.StageMetrics)]),
    _hostile_numbers, max_size=6)


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_hostile_stage_figures_leave_every_job_storable(leader: Leader,
                                                        data: st.DataObject) -> None:
    """Three stages of a train job report figures drawn at and past every bound, step after
    step: each report is taken or refused (400), and the job can always be listed, read and
    stored (its row reloads as the leader holds it)."""
    async def go() -> None:
        ws = [await leader.worker(f"stage{i}") for i in range(3)]
        s, running = await leader.call("GET", f"{A}/jobs", params={"state": "RUNNING"})
        if running["jobs"]:
            job = running["jobs"][0]
        else:
            s, job = await leader.call("POST", f"{A}/jobs", {
                "kind": "train", "topology": {"fellows": 3}, "training": {"steps": 10**6},
                "model": {"d_model": 16, "n_layers": 3, "n_heads": 2, "seq_len": 8}})
            assert s == 201 and job["state"] == "RUNNING", job
        by_id = {w["fellow_id"]: w for w in ws}
        step = job["last_step"] + 1
        # Mostly every stage sends the same figures, one summed count at an extreme: sums of
        # the stages' figures are where bounds break.
        summed = data.draw(st.sampled_from(["wire_tx_bytes", "sync_tx_bytes"]))
        shared = {**data.draw(_hostile_metrics), summed: data.draw(_extreme_counts)}
        for cell in job["placement"]["stages"]:
            w = by_id[cell["fellow_id"]]
            body = {"fellow_id": w["fellow_id"], "state": "RUNNING", "step": step,
                    "stage": cell["stage"], "attempt": job["attempt"], "loss": 1.0,
                    "metrics": data.draw(st.sampled_from([shared] * 3) | _hostile_metrics,
                                         label=f"stage {cell['stage']}")}
            status, _ = await leader.call("POST", f"{A}/jobs/{job['job_id']}/status", body,
                                          w["headers"])
            event(f"HTTP {status}")
            assert status in (200, 400)
        for path in ("/jobs", f"/jobs/{job['job_id']}", f"/jobs/{job['job_id']}/progress"):
            status, _ = await leader.call("GET", f"{A}{path}")
            assert status == 200
        # The stored row is the job the leader holds: it reloads as it is served.
        state = leader.state()
        row = next(r for r in state.store.load_jobs() if r["job_id"] == job["job_id"])
        held = state.jobs.get(job["job_id"])
        assert JobRecord.from_row(row).row() == held.row()
        for w in ws:
            await leader.flush_signals(w)

    leader.run(go())


@FUZZ
@given(segment=st.text(max_size=12), after=st.text(max_size=8), wait=st.text(max_size=8),
       state=st.text(max_size=10), job=st.text(max_size=12))
def test_path_and_query_values_never_5xx(leader: Leader, segment: str, after: str, wait: str,
                                         state: str, job: str) -> None:
    async def go() -> None:
        w = await leader.worker()
        seg = quote(segment, safe="")
        await leader.call("GET", f"{A}/fellows/{seg}")
        await leader.call("POST", f"{A}/fellows/{seg}/speed", {"tx_mbps": 1})
        await leader.call("POST", f"{A}/fellows/{seg}/heartbeat", {}, w["headers"])
        await leader.call("GET", f"{A}/fellows/{w['fellow_id']}/signals", headers=w["headers"],
                          params={"after": after, "wait": wait if wait.strip() else "0"})
        await leader.call("GET", f"{A}/jobs", params={"state": state})
        jid = quote(job, safe="")
        await leader.call("GET", f"{A}/jobs/{jid}")
        await leader.call("POST", f"{A}/jobs/{jid}/cancel")

    leader.run(go())


# --- structure() directly -----------------------------------------------------------------------

# Every API body and what they carry: the protocol's and the job contract's classes.
CONTRACT_MODULES = (protocol, contract_heartbeat, contract_job, contract_metrics,
                    contract_placement, contract_start)
PROTOCOL_CLASSES = sorted(
    (obj for mod in CONTRACT_MODULES for obj in vars(mod).values()
     if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == mod.__name__),
    key=lambda c: c.__name__,
)


def test_protocol_classes_found() -> None:
    names = {c.__name__ for c in PROTOCOL_CLASSES}
    assert {"RegisterRequest", "Heartbeat", "SetSpeedRequest", "ReleaseRequest", "JobSubmit",
            "JobStatusUpdate", "FellowInfo", "JobInfo", "SignalBatch", "StageStart",
            "StageMetrics", "Placement", "CellRef", "UnreportedFinal"} <= names


@settings(max_examples=300, deadline=None)
@given(cls=st.sampled_from(PROTOCOL_CLASSES), strict=st.booleans(), data=st.data())
def test_structure_returns_instance_or_schema_error(cls: type, strict: bool,
                                                     data: st.DataObject) -> None:
    value = data.draw(st.one_of(py_values, field_dicts(cls, py_values),
                                field_dicts(cls, json_values)), label="value")
    try:
        out = structure(value, cls, strict=strict)
    except SchemaError as exc:
        event("SchemaError")
        assert isinstance(exc.message, str) and exc.message
        assert exc.field is None or exc.field.startswith("$")
        assert str(exc)
    else:
        event("instance")
        assert isinstance(out, cls)
