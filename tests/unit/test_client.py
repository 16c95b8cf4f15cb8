"""The one client of the leader API, against answers no leader should give: every call turns
them into the client's own errors (ApiError, LeaderUnreachable), never a JSON or aiohttp
exception that its callers (the CLI, a fellow) did not plan for."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from swarm_core.client import ApiError, LeaderUnreachable, SwarmClient

MANIFEST = {"job_id": "job-000001", "stage": 0, "step": 1}


@pytest.fixture
async def proxy_page(aiohttp_server) -> AsyncIterator[str]:
    """A server that answers everything as a failing proxy does: 502 with an HTML page."""

    async def html(_: web.Request) -> web.Response:
        return web.Response(status=502, text="<html><body>Bad Gateway</body></html>",
                            content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", html)
    server = await aiohttp_server(app)
    yield str(server.make_url("")).rstrip("/")


async def test_a_non_json_answer_is_an_api_error_on_every_call(proxy_page):
    async with SwarmClient(proxy_page, None) as client:
        calls = {
            "request": client.health(),
            "push_shard": client.push_shard("job-000001", 0, "s", MANIFEST, b"npz"),
            "checkpoint": client.checkpoint("job-000001", 1, 0, "s"),
        }
        for name, call in calls.items():
            with pytest.raises(ApiError) as info:
                await call
            assert (info.value.status, info.value.code) == (502, "bad_response"), name
            assert "leader sent non-JSON (502): b'<html>" in str(info.value), name


async def test_an_answer_cut_short_is_an_unreachable_leader():
    """The connection closes mid-body (aiohttp's payload error): the leader is unreachable."""

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"ok\"")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with SwarmClient(f"http://127.0.0.1:{port}", None) as client:
            with pytest.raises(LeaderUnreachable, match="cannot reach the leader at"):
                await client.health()
            with pytest.raises(LeaderUnreachable, match="cannot reach the leader at"):
                await client.push_shard("job-000001", 0, "s", MANIFEST, b"npz")
    finally:
        server.close()
        await server.wait_closed()


async def _event_server(aiohttp_server, *frames: str) -> str:
    """A leader stand-in whose event stream sends ``frames``, then closes: its base URL."""

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        for frame in frames:
            await ws.send_str(frame)
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/api/v1/events", ws_handler)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_a_non_json_event_is_an_api_error(aiohttp_server):
    url = await _event_server(aiohttp_server, '{"type": "hello"}', "<html>")
    got = []
    async with SwarmClient(url, None) as client:
        with pytest.raises(ApiError, match="leader sent a non-JSON event: '<html>'"):
            async for event in client.events():
                got.append(event)
    assert got == [{"type": "hello", "data": {}}]


@pytest.mark.parametrize(("frame", "says"), [
    ("[1, 2]", "that is not a JSON object"),
    ('{"data": {}}', "with no string 'type'"),
    ('{"type": 3}', "with no string 'type'"),
    ('{"type": "metric", "data": [1]}', "whose 'data' is not an object"),
    ('{"type": "metric", "seq": "7"}', "whose 'seq' is not an integer"),
    ('{"type": "metric", "seq": true}', "whose 'seq' is not an integer"),
    ('{"type": "metric", "ts": "noon"}', "whose 'ts' is not a number"),
])
async def test_an_event_that_is_no_event_is_an_api_error(aiohttp_server, frame, says):
    """The envelope the console and ``swarm watch`` read is checked here, once: a frame from
    something that is no leader of ours ends the stream in words, after the good events."""

    url = await _event_server(aiohttp_server, '{"type": "hello", "seq": 1, "ts": 1.5}', frame)
    got = []
    async with SwarmClient(url, None) as client:
        with pytest.raises(ApiError) as info:
            async for event in client.events():
                got.append(event)
    assert got == [{"type": "hello", "seq": 1, "ts": 1.5, "data": {}}]
    assert info.value.code == "bad_response"
    assert str(info.value) == f"leader sent an event {says}: {frame!r}"


async def test_an_event_stream_lost_midway_is_an_unreachable_leader(aiohttp_server):
    """The connection drops after one event (no close frame): not the end of the stream, a
    leader gone, which callers retry; a close the leader sends ends it quietly."""

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str('{"type": "hello"}')
        if request.query.get("types") == "cut":
            assert request.transport is not None
            request.transport.abort()
        else:
            await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/api/v1/events", ws_handler)
    server = await aiohttp_server(app)
    async with SwarmClient(str(server.make_url("")).rstrip("/"), None) as client:
        got = [ev async for ev in client.events()]
        assert got == [{"type": "hello", "data": {}}]
        got = []
        with pytest.raises(LeaderUnreachable, match="event stream lost"):
            async for event in client.events(types=["cut"]):
                got.append(event)
        assert got == [{"type": "hello", "data": {}}]


@pytest.mark.parametrize("url", ["localhost:8080", "ftp://h/", "http://", "127.0.0.1"])
def test_a_leader_url_aiohttp_cannot_use_is_refused_at_once(url):
    with pytest.raises(ValueError, match="is not http"):
        SwarmClient(url, None)


async def test_waiting_for_a_job_returns_it_once_it_ends_or_once_asked_for_holds(api):
    """``wait_job`` (scripts and benchmarks): against a real leader, a job with no fellow to
    run it stays PENDING, so waiting until it is PENDING returns at once, and a plain wait
    returns the job as the leader has it once it is cancelled."""
    from tests.api_support import submit
    from tests.support import AUTH

    job_id = (await submit(api))["job_id"]
    url = str(api.make_url("")).rstrip("/")
    async with SwarmClient(url, AUTH["Authorization"].split()[1]) as client:
        seen = await asyncio.wait_for(
            client.wait_job(job_id, 0.01, until=lambda j: j.state == "PENDING"), 5)
        assert (seen.job_id, seen.state) == (job_id, "PENDING")
        waiting = asyncio.create_task(client.wait_job(job_id, 0.01))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # (still pending: nothing ended it)
        await client.cancel(job_id)
        ended = await asyncio.wait_for(waiting, 5)
        with pytest.raises(ValueError, match="poll_s must be above 0"):
            await client.wait_job(job_id, 0)
    assert (ended.job_id, ended.state) == (job_id, "CANCELLED")
