"""The shared bearer token: generated on first start, kept 0600 in the state dir."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from aiohttp import web

from swarm_core.leader.errors import Handler, error_response
from swarm_core.paths import atomic_write, ensure_private_dir

TOKEN_FILE = "token"
PUBLIC_PATHS = frozenset({"/healthz"})


def load_or_create_token(state_dir: Path, explicit: str | None = None) -> str:
    """``explicit`` (from ``SWARM_TOKEN``) wins; otherwise the state dir's token, made if absent."""
    ensure_private_dir(state_dir)
    if explicit:
        return explicit
    path = state_dir / TOKEN_FILE
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    atomic_write(path, token.encode() + b"\n", mode=0o600)
    return token


def read_token(state_dir: Path) -> str | None:
    path = state_dir / TOKEN_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def auth_middleware(token: str) -> Handler:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return error_response(401, "unauthorized",
                                  "missing or wrong bearer token (see SWARM_TOKEN or --token)")
        return await handler(request)

    return middleware


__all__ = ["PUBLIC_PATHS", "auth_middleware", "load_or_create_token", "read_token"]

