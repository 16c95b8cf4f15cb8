"""Request bodies sent with a ``Content-Encoding``: the leader decodes them itself.

aiohttp's own decoding (``auto_decompress``) happens in its HTTP parser, before any middleware:
an encoding it cannot decode (``br`` without the brotli package, ``zstd``) got its plain-text 400
and a traceback in the leader log, not the API's error object. So the app turns it off
(``handler_args``) and JSON bodies pass through :func:`decode`: ``identity``, ``gzip`` and
``deflate`` are read, with the decoded size held to the same limit as a plain body (a small
compressed body may not unpack into gigabytes); anything else is a 415 naming the encoding.
"""

from __future__ import annotations

import zlib

from aiohttp import web

from swarm_core.leader.errors import ApiError

# wbits per coding: gzip framing, and deflate's zlib framing (RFC 9110; raw deflate, which some
# clients send instead, is tried when the zlib header is missing).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
HANDLER_ARGS = {"auto_decompress": False}


def named(request: web.Request) -> str:
    """The request's content coding as sent, lower case; ``identity`` when there is none."""
    return request.headers.get("Content-Encoding", "").strip().lower() or "identity"


def coding(request: web.Request) -> str:
    """The request's content coding, lower case; 415 when the leader cannot decode it."""
    value = named(request)
    if value == "identity":
        return value
    if value not in _WBITS:
        raise ApiError(415, f"Content-Encoding {value[:40]!r} is not supported (identity, gzip "
                            "or deflate)")
    return value


def decode(request: web.Request, name: str, raw: bytes) -> bytes:
    """``raw`` as sent, decoded per its coding ``name`` (from :func:`coding`), at most
    ``client_max_size`` bytes."""
    if name == "identity" or not raw:
        return raw
    limit = request.client_max_size
    for wbits in (_WBITS[name], -zlib.MAX_WBITS)[: 2 if name == "deflate" else 1]:
        try:
            out = _inflate(raw, wbits, limit)
        except zlib.error:
            continue
        if out is None:
            break  # a stream cut short, or bytes after it
        if len(out) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes once decoded "
                                f"({name})", code="body_too_large")
        return out
    raise ApiError(400, f"body could not be read: it is not valid {name} data",
                   code="invalid_body")


def _inflate(raw: bytes, wbits: int, limit: int) -> bytes | None:
    """Inflate at most ``limit + 1`` bytes (more is over the limit whatever follows); None for
    a stream cut short or followed by stray bytes. Gzip may be several members end to end
    (RFC 1952), as ``gzip.decompress`` reads it."""
    out = bytearray()
    data = raw
    while True:
        d = zlib.decompressobj(wbits)
        # (At least 1: a max_length of 0 would mean no limit.)
        out += d.decompress(data, limit + 1 - len(out))
        if len(out) > limit:
            return bytes(out)
        if not d.eof:
            return None
        data = d.unused_data
        if not data:
            return bytes(out)
        if wbits <= zlib.MAX_WBITS:
            return None  # deflate is one stream
