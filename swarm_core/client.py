"""The one async client of the leader API. The CLI, the console, fellows and scripts use it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from swarm_core import jsonio
from swarm_core.artifacts.layout import names_optimizer
from swarm_core.contract import (
    FellowLog,
    FellowLogTail,
    Heartbeat,
    JobInfo,
    JobList,
    JobStatusBatch,
    JobStatusUpdate,
    JobSubmit,
    ProgressList,
    ProgressRecord,
    RegroupAnswer,
    RegroupReport,
)
from swarm_core.contract.events import Event, Unknown, read_event
from swarm_core.protocol import (
    API_PREFIX,
    SESSION_HEADER,
    FellowInfo,
    FellowList,
    JobState,
    LeaderInfo,
    NodeList,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResult,
    SetSpeedRequest,
    SignalBatch,
)
from swarm_core.schema import SchemaError, structure, unstructure

T = TypeVar("T")
DOWNLOAD_CHUNK = 1 << 20  # bytes of a streamed download read at a time
_ACTIVE = {s.value for s in JobState if not s.terminal}  # (a job not yet ended)


class ClientError(Exception):
    """Base of everything this client raises."""


class LeaderUnreachable(ClientError):
    """No HTTP answer from the leader (refused, timed out, DNS)."""


class ApiError(ClientError):
    """The leader answered with an error body."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field

    def __str__(self) -> str:
        where = f" ({self.field})" if self.field else ""
        return f"{self.message}{where}"


def shown_url(url: str) -> str:
    """``url`` fit for an error line: a password in it is not echoed."""
    return re.sub(r"//([^/@]*?):[^/@]*@", r"//\1:***@", url)


def check_leader_url(url: str) -> str:
    """``url`` if it is http(s)://host[:port]; else a ValueError naming what is wrong. Refused
    up front: a URL aiohttp cannot use would otherwise read as a leader that is down, and a
    fellow would retry it for ever."""
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port  # (.port raises on a bad port)
    except ValueError as exc:
        raise ValueError(f"leader URL {shown_url(url)!r} is not http(s)://host[:port]: {exc}") \
            from None
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"leader URL {shown_url(url)!r} is not http(s)://host[:port]")
    if port == 0:
        raise ValueError(f"leader URL {shown_url(url)!r} has port 0, which nothing listens on")
    return url


class SwarmClient:
    """``async with SwarmClient(url, token) as c: await c.fellows()``.

    Counts the bytes it sends and receives, so a fellow can report its control-plane traffic.
    """

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = 10.0) -> None:
        check_leader_url(base_url)
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.bytes_sent = 0
        self.bytes_received = 0
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SwarmClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(
                headers=headers, json_serialize=lambda o: jsonio.dumps(o).decode()
            )
        return self._session

    async def request(self, method: str, path: str, body: Any = None, *,
                      params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                      timeout_s: float | None = None) -> Any:
        url = f"{self.base_url}{path}"
        data = None if body is None else jsonio.dumps(
            unstructure(body) if not isinstance(body, dict) else body)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._http().request(method, url, data=data, params=params,
                                            headers=hdrs, timeout=timeout) as resp:
                raw = await resp.read()
        except _NO_ANSWER as exc:
            raise self._unreachable(exc) from None
        # Request line and headers are small next to bodies; count bodies plus a fixed estimate.
        self.bytes_sent += len(data or b"") + 200
        self.bytes_received += len(raw) + 150
        return _reply(resp.status, raw)

    def _unreachable(self, exc: BaseException) -> LeaderUnreachable:
        return LeaderUnreachable(f"cannot reach the leader at {shown_url(self.base_url)}: "
                                 f"{_why_unreachable(exc)}")

    async def _get(self, path: str, cls: type[T], **kw: Any) -> T:
        return _parse(await self.request("GET", path, **kw), cls)

    # meta -------------------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/healthz", timeout_s=3.0)

    async def info(self) -> LeaderInfo:
        return await self._get(f"{API_PREFIX}/info", LeaderInfo)

    async def openapi(self) -> dict[str, Any]:
        return await self.request("GET", f"{API_PREFIX}/openapi.json")

    # fellows ----------------------------------------------------------------------------------
    async def fellows(self) -> list[FellowInfo]:
        return (await self._get(f"{API_PREFIX}/fellows", FellowList)).fellows

    async def fellow(self, fellow_id: int) -> FellowInfo:
        return await self._get(f"{API_PREFIX}/fellows/{fellow_id}", FellowInfo)

    async def fellow_log(self, fellow_id: int, lines: int | None = None) -> FellowLog:
        """The tail of a fellow's own log as the leader last received it (asking for it makes
        the fellow send a fresh one within a heartbeat or two: poll to follow it)."""
        params = None if lines is None else {"lines": lines}
        return await self._get(f"{API_PREFIX}/fellows/{fellow_id}/log", FellowLog,
                               params=params)

    async def nodes(self) -> NodeList:
        return await self._get(f"{API_PREFIX}/nodes", NodeList)

    async def set_speed(self, fellow_id: int, req: SetSpeedRequest, *,
                        link: bool = True) -> dict[str, Any]:
        """``link=False``: set ``req.slowdown`` alone, the fellow's link left as it is."""
        body = unstructure(req)
        for field in ("slowdown", "to"):  # (unset; and a leader before them knows neither)
            if body.get(field) is None:
                body.pop(field, None)
        if not link:
            if req.slowdown is None:
                raise ValueError("set_speed(link=False) needs a slowdown")
            body = {"slowdown": req.slowdown}
        return await self.request("POST", f"{API_PREFIX}/fellows/{fellow_id}/speed", body)

    async def release(self, fellow_ids: list[int] | None = None, *, all: bool = False) -> list[int]:
        body = ReleaseRequest(fellow_ids=list(fellow_ids or []), all=all)
        res = await self.request("POST", f"{API_PREFIX}/fellows/release", body)
        return _parse(res, ReleaseResult).released

    async def forget(self, fellow_id: int) -> dict[str, Any]:
        """Drop the record of a fellow that is gone (409: it heartbeats, or holds a running
        job's cell)."""
        res: dict[str, Any] = await self.request("DELETE", f"{API_PREFIX}/fellows/{fellow_id}")
        return res

    # fellow side ------------------------------------------------------------------------------
    async def register(self, req: RegisterRequest) -> RegisterResponse:
        res = await self.request("POST", f"{API_PREFIX}/fellows/register", req)
        return _parse(res, RegisterResponse)

    async def heartbeat(self, fellow_id: int, session: str, hb: Heartbeat) -> dict[str, Any]:
        return await self.request("POST", f"{API_PREFIX}/fellows/{fellow_id}/heartbeat", hb,
                                  headers={SESSION_HEADER: session}, timeout_s=5.0)

    async def post_log(self, fellow_id: int, session: str,
                       tail: FellowLogTail) -> dict[str, Any]:
        return await self.request("POST", f"{API_PREFIX}/fellows/{fellow_id}/log", tail,
                                  headers={SESSION_HEADER: session}, timeout_s=5.0)

    async def poll_signals(self, fellow_id: int, session: str, after: int,
                           wait_s: float) -> SignalBatch:
        res = await self.request(
            "GET", f"{API_PREFIX}/fellows/{fellow_id}/signals",
            params={"after": after, "wait": wait_s}, headers={SESSION_HEADER: session},
            timeout_s=wait_s + 10.0,
        )
        return _parse(res, SignalBatch)

    async def job_status(self, job_id: str, session: str, upd: JobStatusUpdate) -> JobInfo:
        res = await self.request("POST", f"{API_PREFIX}/jobs/{_seg(job_id)}/status", upd,
                                 headers={SESSION_HEADER: session})
        return _parse(res, JobInfo)

    async def job_statuses(self, job_id: str, session: str,
                           updates: Sequence[JobStatusUpdate]) -> JobInfo:
        """Several RUNNING step reports at once, in order (see JobStatusBatch)."""
        res = await self.request("POST", f"{API_PREFIX}/jobs/{_seg(job_id)}/statuses",
                                 JobStatusBatch(list(updates)),
                                 headers={SESSION_HEADER: session})
        return _parse(res, JobInfo)

    async def regroup(self, job_id: str, session: str, rep: RegroupReport,
                      wait_s: float) -> RegroupAnswer:
        """Report a broken ring; the order once the leader has decided (or a null order after
        ``wait_s``: ask again)."""
        res = await self.request("POST", f"{API_PREFIX}/jobs/{_seg(job_id)}/regroup", rep,
                                 params={"wait": wait_s}, headers={SESSION_HEADER: session},
                                 timeout_s=wait_s + 10.0)
        return _parse(res, RegroupAnswer)

    async def push_shard(self, job_id: str, stage: int, session: str,
                         manifest: dict[str, Any], weights: bytes | None,
                         optimizer: bytes | None = None) -> dict[str, Any]:
        """Upload one stage shard (multipart: manifest JSON, the weights.npz bytes, then the
        optimizer.npz bytes when the manifest names them); ``weights`` None for a replica's
        own optimiser state (DiLoCo), which goes beside its stage's checkpoint."""
        with aiohttp.MultipartWriter("form-data") as mp:
            part = mp.append(jsonio.dumps(manifest), {"Content-Type": "application/json"})
            part.set_content_disposition("form-data", name="manifest")
            if weights is not None:
                part = mp.append(weights, {"Content-Type": "application/octet-stream"})
                part.set_content_disposition("form-data", name="weights",
                                             filename="weights.npz")
            if optimizer is not None:
                part = mp.append(optimizer, {"Content-Type": "application/octet-stream"})
                part.set_content_disposition("form-data", name="optimizer",
                                             filename="optimizer.npz")
        size = len(weights or b"") + len(optimizer or b"")
        url = f"{self.base_url}{API_PREFIX}/jobs/{_seg(job_id)}/shards/{stage}"
        timeout = aiohttp.ClientTimeout(total=max(60.0, size / 5e6))
        try:
            async with self._http().post(url, data=mp, headers={SESSION_HEADER: session},
                                         timeout=timeout) as resp:
                raw = await resp.read()
        except _NO_ANSWER as exc:
            raise self._unreachable(exc) from None
        self.bytes_sent += size + 400
        self.bytes_received += len(raw) + 150
        return _reply(resp.status, raw)

    async def checkpoint(self, job_id: str, step: int, stage: int, session: str,
                         weights_only: bool = False
                         ) -> tuple[dict[str, Any], bytes, bytes | None]:
        """(manifest, weights.npz bytes, optimizer.npz bytes or None) of a stage checkpoint, to
        resume from; the optimiser state is fetched when the manifest names it, unless
        ``weights_only`` (a warm start's: another job's weights, never its moments)."""
        base = f"{self.base_url}{API_PREFIX}/jobs/{_seg(job_id)}/checkpoints/{step}/{stage}"
        out: list[bytes] = []
        manifest: dict[str, Any] = {}
        for part in ("manifest", "weights", "optimizer"):
            if part == "optimizer" and (weights_only or not names_optimizer(manifest)):
                break
            status, raw = await self._download(f"{base}/{part}", {SESSION_HEADER: session})
            if part == "optimizer" and status == 404:
                break  # a leader from before optimiser state: resume with fresh moments
            if status >= 400:
                _reply(status, raw)  # raises the leader's error
            out.append(raw)
            if part == "manifest":
                manifest = _reply(status, raw)
        return manifest, out[1], out[2] if len(out) > 2 else None

    async def checkpoint_manifest(self, job_id: str, step: int, stage: int,
                                  session: str) -> dict[str, Any]:
        """The manifest alone of a stage checkpoint (its ``params`` name what the shard
        holds)."""
        status, raw = await self._download(
            f"{self.base_url}{API_PREFIX}/jobs/{_seg(job_id)}/checkpoints/{step}/{stage}"
            "/manifest", {SESSION_HEADER: session})
        manifest = _reply(status, raw)
        if not isinstance(manifest, dict):
            raise ApiError(200, "bad_response", "the leader's checkpoint manifest is not an "
                           "object")
        return manifest

    async def replica_state(self, job_id: str, step: int, stage: int, replica: int,
                            session: str) -> tuple[dict[str, Any], bytes] | None:
        """(manifest, optimizer.npz bytes) of one replica's own state at a stage checkpoint
        (DiLoCo); None where the leader holds none."""
        base = (f"{self.base_url}{API_PREFIX}/jobs/{_seg(job_id)}/checkpoints/{step}/{stage}"
                f"/replicas/{replica}")
        status, raw = await self._download(f"{base}/manifest", {SESSION_HEADER: session})
        if status == 404:
            return None
        manifest = _reply(status, raw)
        status, optimizer = await self._download(f"{base}/optimizer",
                                                 {SESSION_HEADER: session})
        if status == 404:
            return None
        if status >= 400:
            _reply(status, optimizer)
        return manifest, optimizer

    async def _download(self, url: str, headers: dict[str, str] | None = None
                        ) -> tuple[int, bytes]:
        """(status, body) of a GET whose body may be hundreds of MB (weights)."""
        try:
            async with self._http().get(url, headers=headers or {},
                                        timeout=aiohttp.ClientTimeout(total=600)) as resp:
                raw = await resp.read()
        except _NO_ANSWER as exc:
            raise self._unreachable(exc) from None
        self.bytes_received += len(raw) + 150
        return resp.status, raw

    async def _download_to(self, url: str, dest: Path) -> tuple[str, int]:
        """Stream a GET's body into ``dest`` (a new private file, fsynced): (sha256, size).
        Nothing of it is held whole in memory; an error answer raises the leader's error."""
        digest, size = hashlib.sha256(), 0
        try:
            async with self._http().get(url, timeout=aiohttp.ClientTimeout(total=600)) as resp:
                if resp.status >= 400:
                    _reply(resp.status, await resp.content.read(64 * 1024))
                with open(dest, "xb") as fh:  # (x: never through a name someone else put here)
                    os.chmod(dest, 0o600)
                    async for chunk in resp.content.iter_chunked(DOWNLOAD_CHUNK):
                        fh.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                    fh.flush()
                    os.fsync(fh.fileno())
        except (aiohttp.ClientError, TimeoutError) as exc:  # (OSError here is the disk's)
            raise self._unreachable(exc) from None
        self.bytes_received += size + 150
        return digest.hexdigest(), size

    async def export_manifest(self, job_id: str) -> dict[str, Any]:
        """The job's run manifest as the leader holds it (its newest shard per stage)."""
        return await self.request("GET", f"{API_PREFIX}/jobs/{_seg(job_id)}/export")

    async def export_part(self, job_id: str, stage: int, part: str) -> bytes:
        """One part (``manifest`` or ``weights``) of a stage's newest pushed shard."""
        status, raw = await self._download(
            f"{self.base_url}{API_PREFIX}/jobs/{_seg(job_id)}/export/{stage}/{part}")
        if status >= 400:
            _reply(status, raw)  # raises the leader's error
        return raw

    async def export_part_to(self, job_id: str, stage: int, part: str, dest: Path
                             ) -> tuple[str, int]:
        """One part of a stage's newest pushed shard, streamed into the new file ``dest``:
        its (sha256, size)."""
        return await self._download_to(
            f"{self.base_url}{API_PREFIX}/jobs/{_seg(job_id)}/export/{stage}/{part}", dest)

    # jobs -------------------------------------------------------------------------------------
    async def submit(self, req: JobSubmit) -> JobInfo:
        return _parse(await self.request("POST", f"{API_PREFIX}/jobs", req), JobInfo)

    async def jobs(self, state: str | Iterable[str] | None = None) -> list[JobInfo]:
        """Every job (of ``state``: one or several), in queue order."""
        return (await self._get(f"{API_PREFIX}/jobs", JobList,
                                params=_job_params(state, "queue"))).jobs

    async def job_page(self, state: str | Iterable[str] | None = None, *, limit: int,
                       after: str | None = None, order: str = "queue") -> JobList:
        """Up to ``limit`` jobs (of ``state``) in ``order`` after job ``after``;
        ``next_after`` continues, ``total`` counts them on all pages."""
        params = _job_params(state, order)
        params["limit"] = limit
        if after:
            params["after"] = after
        return await self._get(f"{API_PREFIX}/jobs", JobList, params=params)

    async def job(self, job_id: str) -> JobInfo:
        return await self._get(f"{API_PREFIX}/jobs/{_seg(job_id)}", JobInfo)

    async def wait_job(self, job_id: str, poll_s: float = 0.5,
                       until: Callable[[JobInfo], bool] | None = None) -> JobInfo:
        """The job as the leader has it once it has ended (any state past PENDING and
        RUNNING), or once ``until`` holds of it, read every ``poll_s`` seconds (scripts and
        benchmarks; the console follows events)."""
        if not poll_s > 0:
            raise ValueError(f"poll_s must be above 0, got {poll_s}")
        while True:
            job = await self.job(job_id)
            if job.state not in _ACTIVE or (until is not None and until(job)):
                return job
            await asyncio.sleep(poll_s)

    async def progress(self, job_id: str, after: int = 0) -> list[ProgressRecord]:
        res = await self.request("GET", f"{API_PREFIX}/jobs/{_seg(job_id)}/progress",
                                 params={"after": after})
        return _parse(res, ProgressList).records

    async def cancel(self, job_id: str) -> JobInfo:
        res = await self.request("POST", f"{API_PREFIX}/jobs/{_seg(job_id)}/cancel")
        return _parse(res, JobInfo)

    # events -----------------------------------------------------------------------------------
    async def event_stream(self, *, types: list[str] | None = None,
                           job_id: str | None = None) -> AsyncIterator[Event]:
        """The leader's events as their classes, each frame read once, until the stream
        closes. A kind this client does not know comes as ``Unknown`` (callers skip it; its
        ``seq`` still counts); one whose data does not read ends the stream as an ApiError
        naming the field, as a frame that is no event does."""
        async for frame in self.events(types=types, job_id=job_id):
            event = read_event(frame)
            if isinstance(event.data, Unknown) and event.data.problem:
                raise ApiError(200, "bad_response",
                               f"leader sent a {event.type} event that does not read: "
                               f"{event.data.problem}")
            yield event

    async def events(self, *, types: list[str] | None = None,
                     job_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Yield the frames of the leader's WebSocket as JSON objects until it closes (the
        envelope checked; ``event_stream`` reads them as classes)."""
        params: dict[str, str] = {}
        if types:
            params["types"] = ",".join(types)
        if job_id:
            params["job_id"] = job_id
        url = f"{self.base_url}{API_PREFIX}/events"
        try:
            ws = await self._http().ws_connect(url, params=params, heartbeat=20.0)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status == 401:
                raise ApiError(401, "unauthorized", "missing or wrong bearer token") from None
            raise ApiError(exc.status, "error", f"event stream refused: {exc.message}") from None
        except _NO_ANSWER as exc:
            raise self._unreachable(exc) from None
        async with ws:
            while True:
                try:
                    msg = await ws.receive()
                except _NO_ANSWER as exc:
                    raise self._unreachable(exc) from None
                if msg.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    self.bytes_received += len(msg.data)
                    yield _event(msg.data)
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    raise self._unreachable(msg.data)
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                                  aiohttp.WSMsgType.CLOSED):
                    # aiohttp reports a lost connection as a close (code 1006): only a close
                    # the leader sent (normal, or going away as it stops) ends the stream.
                    if ws.close_code not in _CLOSED_BY_LEADER:
                        raise self._unreachable(ConnectionError(
                            f"event stream lost (close code {ws.close_code})"))
                    break


def _event(raw: str | bytes) -> dict[str, Any]:
    """One event frame, checked as an envelope: an object with a string ``type``, an object
    ``data`` (``{}`` when absent), an integer ``seq`` and a numeric ``ts`` where present. What
    its callers (the console, ``swarm watch``) read past that they read with ``.get``; a frame
    from something that is no leader of ours ends the stream as an ApiError saying so, not as
    an AttributeError deep in the console."""
    try:
        event = jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        raise ApiError(200, "bad_response",
                       f"leader sent a non-JSON event: {raw[:80]!r}") from None
    problem = None
    if not isinstance(event, dict):
        problem = "that is not a JSON object"
    elif not isinstance(event.get("type"), str):
        problem = "with no string 'type'"
    elif not isinstance(event.setdefault("data", {}), dict):
        problem = "whose 'data' is not an object"
    elif "seq" in event and (not isinstance(event["seq"], int) or isinstance(event["seq"], bool)):
        problem = "whose 'seq' is not an integer"
    elif "ts" in event and (not isinstance(event["ts"], int | float)
                            or isinstance(event["ts"], bool)):
        problem = "whose 'ts' is not a number"
    if problem:
        raise ApiError(200, "bad_response",
                       f"leader sent an event {problem}: {raw[:80]!r}")
    return event


# No answer at all (refused, reset, timed out, a reply cut short): aiohttp.ClientError covers
# its connection and payload errors.
_NO_ANSWER = (aiohttp.ClientError, TimeoutError, OSError)


_CLOSED_BY_LEADER = (aiohttp.WSCloseCode.OK, aiohttp.WSCloseCode.GOING_AWAY)


def _why_unreachable(exc: BaseException) -> str:
    """What went wrong, in words a person acts on (the console and the CLI show it as is)."""
    os_error = getattr(exc, "os_error", None)  # (aiohttp's connector errors wrap one)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return f"cannot resolve {getattr(exc, 'host', 'the host')}"
    if isinstance(exc, ConnectionRefusedError) or isinstance(os_error, ConnectionRefusedError):
        return "connection refused (is the leader running there?)"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the leader closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer was cut short"
    cause = os_error if isinstance(os_error, OSError) else exc
    if isinstance(cause, OSError):
        # (strerror where there is an errno; else the text: happy eyeballs joins the errors
        # of every address it tried)
        detail = cause.strerror or (str(cause.args[0]) if cause.args else "")
    else:
        detail = str(exc)
    return f"the connection failed: {detail}" if detail else "the connection failed"


def _reply(status: int, raw: bytes) -> Any:
    """The JSON body of a leader's answer; an ApiError for an error status or a body that is
    not JSON (a proxy's HTML page, say)."""
    try:
        payload = jsonio.loads(raw) if raw else {}
    except jsonio.JSONDecodeError:
        raise ApiError(status, "bad_response",
                       f"leader sent non-JSON ({status}): {raw[:80]!r}") from None
    if status >= 400:
        err = payload.get("error", {}) if isinstance(payload, dict) else {}
        err = err if isinstance(err, dict) else {}
        raise ApiError(status, err.get("code", "error"),
                       err.get("message", f"HTTP {status}"), err.get("field"))
    return payload


def _parse(payload: Any, cls: type[T]) -> T:
    try:
        return structure(payload, cls, trust=True)
    except SchemaError as exc:
        raise ApiError(200, "bad_response", f"unexpected response from leader: {exc}") from None


async def wait_for_leader(url: str, timeout_s: float) -> None:
    """Poll /healthz until it answers or ``timeout_s`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with SwarmClient(url, None) as c:
        while True:
            try:
                await c.health()
                return
            except ClientError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.1)


def _job_params(state: str | Iterable[str] | None, order: str) -> dict[str, Any]:
    params: dict[str, Any] = {} if order == "queue" else {"order": order}
    if state:
        params["state"] = state if isinstance(state, str) else ",".join(state)
    return params


def _seg(value: object) -> str:
    """One URL path segment: an id like ``../info`` must not walk to another route."""
    return urllib.parse.quote(str(value), safe="")
