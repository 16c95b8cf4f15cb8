"""The shared bearer token: generated on first start, kept 0600 in the state dir."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

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
        token = _token_text(path)
        if token:
            return token
    token = new_token()
    atomic_write(path, token.encode() + b"\n", mode=0o600)
    return token


def new_token() -> str:
    """A random token that never starts with "-": one that did (1 in 32) would read as an
    option in ``swarm --token TOKEN`` and every other command line that passes it."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


class TokenFileError(ValueError):
    """The state dir's token file holds something that is not a token."""


def read_token(state_dir: Path) -> str | None:
    """The state dir's token; None if there is none to read. A TokenFileError if the file is
    not a token (sending it would only earn a 401 that blames the token, not the file)."""
    try:
        return _token_text(state_dir / TOKEN_FILE) or None
    except OSError:
        return None


def _token_text(path: Path) -> str:
    try:
        token = path.read_bytes().decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"{path}: not a token (expected one line of ASCII text); remove it "
                         "and restart the leader to make a new one") from None
    if any(c.isspace() for c in token):
        raise TokenFileError(f"{path}: not a token (it holds whitespace); remove it and restart "
                         "the leader to make a new one")
    return token


def auth_middleware(token: str) -> Middleware:
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


__all__ = ["PUBLIC_PATHS", "TokenFileError", "auth_middleware", "load_or_create_token",
           "read_token"]

