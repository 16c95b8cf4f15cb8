"""What the leader API's tests share: the routes' prefix, requests as a fellow or a user
sends them, replies checked, and running jobs of several replicas to report against."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp.test_utils import TestClient

from swarm_core.leader.routes import SESSION_HEADER
from tests.support import AUTH

A = "/api/v1"
JSON = {**AUTH, "Content-Type": "application/json"}


async def expect_error(resp, status: int, code: str | None = None,
                       field: str | None = None) -> dict[str, Any]:
    """Assert an ``{"error": {...}}`` reply with this status (and code / field when given)."""
    text = await resp.text()
    assert resp.status == status, text
    assert resp.content_type == "application/json"
    err = orjson.loads(text)["error"]
    assert isinstance(err["code"], str) and err["code"]
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if field is not None:
        assert err.get("field") == field, err
    return err


async def expect_ok(resp, status: int = 200) -> Any:
    text = await resp.text()
    assert resp.status == status, text
    return orjson.loads(text)


async def register(api: TestClient, name: str = "f0", instance_id: str | None = None,
                   **extra: Any) -> dict[str, Any]:
    """Register a fellow; the reply plus ``headers`` (token and session) for its own calls."""
    body = {"name": name, "instance_id": instance_id or f"{name}-inst", **extra}
    reg = await expect_ok(await api.post(f"{A}/fellows/register", json=body, headers=AUTH), 201)
    reg["headers"] = {**AUTH, SESSION_HEADER: reg["session"]}
    reg["body"] = body  # (to register again, as the same process, with a restarted leader)
    return reg


async def heartbeat(api: TestClient, reg: dict[str, Any], **body: Any) -> dict[str, Any]:
    resp = await api.post(f"{A}/fellows/{reg['fellow_id']}/heartbeat", json=body,
                          headers=reg["headers"])
    return await expect_ok(resp)


async def poll(api: TestClient, reg: dict[str, Any], after: int = 0,
               wait: float = 0.0) -> list[dict[str, Any]]:
    resp = await api.get(f"{A}/fellows/{reg['fellow_id']}/signals",
                         params={"after": str(after), "wait": str(wait)}, headers=reg["headers"])
    return (await expect_ok(resp))["signals"]


async def submit(api: TestClient, fellows: int = 1, **body: Any) -> dict[str, Any]:
    body = {"name": "j", "kind": "smoke", "topology": {"fellows": fellows}, **body}
    return await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201)


async def get_job(api: TestClient, job_id: str) -> dict[str, Any]:
    return await expect_ok(await api.get(f"{A}/jobs/{job_id}", headers=AUTH))


async def get_fellow(api: TestClient, fellow_id: int) -> dict[str, Any]:
    return await expect_ok(await api.get(f"{A}/fellows/{fellow_id}", headers=AUTH))


async def report(api: TestClient, job_id: str, reg: dict[str, Any], state: str,
                 step: int = 0, **extra: Any):
    body = {"fellow_id": reg["fellow_id"], "state": state, "step": step, **extra}
    return await api.post(f"{A}/jobs/{job_id}/status", json=body, headers=reg["headers"])


async def wait_for(cond, timeout: float = 3.0, interval: float = 0.02) -> Any:
    """Await ``cond()`` (async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await cond()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(interval)


async def wait_until_failed(api: TestClient, job_id: str) -> dict[str, Any]:
    async def failed() -> dict[str, Any] | None:
        job = await get_job(api, job_id)
        return job if job["state"] == "FAILED" else None

    return await wait_for(failed, timeout=5.0, interval=0.05)


@contextlib.asynccontextmanager
async def beating(api: TestClient, regs: list[dict[str, Any]], step: int,
                  alive: set[int] | None = None, job_id: str | None = None
                  ) -> AsyncIterator[None]:
    """Busy heartbeats from ``regs`` every 50 ms, while the block runs, from those whose
    fellow id is in ``alive`` (all by default; the set may shrink meanwhile). ``job_id``:
    each also says it runs its cell of that job (stage 0, replica its place in ``regs``)."""
    alive = {r["fellow_id"] for r in regs} if alive is None else alive

    def running(replica: int) -> dict[str, Any]:
        if job_id is None:
            return {}
        return {"current_job": job_id,
                "running": [{"job_id": job_id, "stage": 0, "replica": replica}]}

    async def beat() -> None:
        while True:
            for replica, reg in enumerate(regs):
                if reg["fellow_id"] in alive:
                    await heartbeat(api, reg, status="busy", current_step=step,
                                    **running(replica))
            await asyncio.sleep(0.05)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()


async def next_event(ws, type_prefix: str, timeout: float = 2.0, **match: Any) -> dict[str, Any]:
    """The next event whose type starts with ``type_prefix`` and whose data matches ``match``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {type_prefix} event {match} in time"
        ev = orjson.loads(await ws.receive_bytes(timeout=left))
        if ev["type"].startswith(type_prefix) and all(
                ev["data"].get(k) == v for k, v in match.items()):
            return ev


async def drain(ws, quiet_s: float = 0.15) -> list[dict[str, Any]]:
    """All events that arrive until the socket is quiet for ``quiet_s``."""
    out = []
    while True:
        try:
            msg = await ws.receive(timeout=quiet_s)
        except TimeoutError:
            return out
        if msg.type.name != "BINARY":
            return out
        out.append(orjson.loads(msg.data))


async def collect_until(ws, type_: str, timeout: float = 2.0,
                        **match: Any) -> list[dict[str, Any]]:
    """Every event up to and including the first ``type_`` event whose data matches ``match``,
    then whatever else arrives within a short quiet period."""
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {type_} event {match} in time; got {out}"
        ev = orjson.loads(await ws.receive_bytes(timeout=left))
        out.append(ev)
        if ev["type"] == type_ and all(ev["data"].get(k) == v for k, v in match.items()):
            return out + await drain(ws, 0.1)


def raw(body: bytes | str, content_type: str = "application/json") -> dict[str, Any]:
    data = body.encode() if isinstance(body, str) else body
    return {"data": data, "headers": {**AUTH, "Content-Type": content_type}}


async def replicated_job(api: TestClient, port: int, **training: Any
                         ) -> tuple[str, dict[int, dict[str, Any]]]:
    """A running job of one stage and three replicas on three fellows registered for it (data
    addresses from ``port`` on): its id, and the fellow of each replica."""
    fellows = [await register(api, f"f{i}", data_addr=f"127.0.0.1:{port + i}")
               for i in range(3)]
    body = {"name": "r", "kind": "train",
            "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 8},
            "training": {"steps": 50, "batch_size": 6, "micro_batches": 1, **training},
            "topology": {"stages": 1, "replicas": 3}}
    jid = (await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201))["job_id"]
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING"
    return jid, {c["replica"]: next(f for f in fellows if f["fellow_id"] == c["fellow_id"])
                 for c in job["placement"]["stages"]}


async def grid_job(api: TestClient, port: int
                    ) -> tuple[str, dict[str, Any], dict[tuple[int, int], dict[str, Any]]]:
    """A running job of two stages and two replicas on four fellows registered for it (data
    addresses from ``port`` on): its id, the job, and the fellow of each (stage, replica)."""
    fellows = [await register(api, f"f{i}", data_addr=f"127.0.0.1:{port + i}")
               for i in range(4)]
    body = {"name": "r", "kind": "train",
            "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
            "training": {"steps": 50, "batch_size": 4, "micro_batches": 1},
            "topology": {"stages": 2, "replicas": 2}}
    jid = (await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201))["job_id"]
    job = await get_job(api, jid)
    return jid, job, {(c["stage"], c["replica"]): next(f for f in fellows
                                                       if f["fellow_id"] == c["fellow_id"])
                      for c in job["placement"]["stages"]}
