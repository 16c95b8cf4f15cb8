"""API errors and the middleware that turns every failure into ``{"error": {...}}``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from swarm_core import jsonio
from swarm_core.leader.store import StoreWriteError
from swarm_core.schema import SchemaError

log = logging.getLogger("swarm.leader")

_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code or _CODES.get(status, "error")
        self.message = message
        self.field = field


def error_body(status: int, code: str, message: str, field: str | None = None) -> bytes:
    err: dict[str, str] = {"code": code, "message": message}
    if field:
        err["field"] = field
    return jsonio.dumps({"error": err})


def error_response(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, code, message, field),
        content_type="application/json",
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.code, exc.message, exc.field)
    except SchemaError as exc:
        return error_response(400, "invalid_body", exc.message, exc.field)
    except StoreWriteError as exc:
        # Nothing of the change stayed (leader/undo.py): a transient cause (a full disk) is
        # worth the caller's retry, and a fellow retries a 503.
        log.error("%s %s: %s", request.method, request.path, exc)
        if exc.transient:
            return error_response(503, "not_stored", "the leader could not store this and "
                                  f"changed nothing ({exc}); try again")
        return error_response(500, "not_stored", "the leader could not store this and "
                              f"changed nothing ({exc})")
    except web.HTTPRequestEntityTooLarge:
        limit = request.client_max_size
        return error_response(413, "body_too_large",
                              f"request body exceeds the limit of {limit} bytes")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 404 else f"no route {request.method} {request.path}"
        resp = error_response(exc.status, _CODES.get(exc.status, "error"), message)
        if isinstance(exc, web.HTTPMethodNotAllowed):
            resp.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
        return resp
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal", "internal error; see the leader log")
