"""The OpenAPI 3.0 document, built from the route table and the attrs body classes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import attrs

import swarm_core
from swarm_core.protocol import SESSION_HEADER
from swarm_core.schema import json_schema

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field": {"type": "string"},
            },
        }
    },
}

_STATUS_TEXT = {
    400: "Bad request (for /events: not a WebSocket upgrade)", 401: "Missing or wrong token",
    403: "Wrong fellow", 404: "Not found", 409: "Conflict with current state",
    413: "Body too large", 415: "Not JSON",
    503: "Not stored (the state dir's disk is full): nothing changed; try again",
}


# Path parameters that are whole numbers (the router matches them as digits only).
INT_PATH_PARAMS = ("fellow_id", "stage", "step", "replica")


_INT64_MAX = 2**63 - 1
# A shard push (Route.upload): its parts, described rather than typed (they are files).
_UPLOAD_BODY = {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["manifest"],
               "description": "manifest, weights, then optimizer when the manifest names it; "
                              "a replica's own optimiser state (no weights_sha256): manifest, "
                              "optimizer",
               "properties": {"manifest": {"type": "string",
                                           "description": "shard manifest JSON"},
                              "weights": {"type": "string", "format": "binary"},
                              "optimizer": {"type": "string", "format": "binary"}}},
}}}
_CREATED = ("register", "submit_job", "push_shard")
_ACCEPTED = ("set_speed", "release")


def build_openapi(routes: Iterable[Any]) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    paths: dict[str, Any] = {}
    for r in routes:
        paths.setdefault(r.path, {})[r.method.lower()] = _operation(r, components)
    return {
        "openapi": "3.0.3",
        "info": {"title": "SilentSwarm leader API", "version": swarm_core.__version__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _operation(r: Any, components: dict[str, Any]) -> dict[str, Any]:
    """One route's operation; the schemas of the classes it names land in ``components``."""
    op: dict[str, Any] = {"summary": r.summary, "operationId": r.handler.__name__,
                          "responses": {}}
    params = _parameters(r)
    if params:
        op["parameters"] = params
    body = _request_body(r, components)
    if body is not None:
        op["requestBody"] = body
    op["responses"] = _responses(r, components)
    if not r.auth:
        op["security"] = []
    return op


def _parameters(r: Any) -> list[dict[str, Any]]:
    """Path parameters (whole numbers by INT_PATH_PARAMS), query parameters, and the session
    header of a fellow's route."""
    params = []
    for name in re.findall(r"{(\w+)}", r.path):
        schema: dict[str, Any] = {"type": "string"}
        if name in INT_PATH_PARAMS:
            schema = {"type": "integer", "minimum": 0, "maximum": _INT64_MAX}
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    for name, kind, desc, *extra in r.query:
        schema = {"type": kind, **(extra[0] if extra else {})}
        if kind in ("integer", "number"):
            schema.setdefault("minimum", 0)
        if kind == "integer":
            schema.setdefault("maximum", _INT64_MAX)
        params.append({"name": name, "in": "query", "required": False,
                       "description": desc, "schema": schema})
    if r.fellow_session:
        params.append({"name": SESSION_HEADER, "in": "header", "required": True,
                       "description": "session returned by register",
                       "schema": {"type": "string"}})
    return params


def _request_body(r: Any, components: dict[str, Any]) -> dict[str, Any] | None:
    if r.body is not None:
        has_required = any(f.default is attrs.NOTHING for f in attrs.fields(r.body)) \
            or bool(getattr(r.body, "__json_schema__", None))
        return {"required": has_required,
                "content": {"application/json": {"schema": json_schema(r.body, components)}}}
    return _UPLOAD_BODY if r.upload else None


def _responses(r: Any, components: dict[str, Any]) -> dict[str, Any]:
    """The success (201 for what creates, 202 for what a fellow applies later, else 200;
    a WebSocket's upgrade before it) and the errors the route can answer with."""
    responses: dict[str, Any] = {}
    name = r.handler.__name__
    if name == "events":
        responses["101"] = {"description": "WebSocket upgrade: one JSON event a frame"}
    ok_status = "201" if name in _CREATED else ("202" if name in _ACCEPTED else "200")
    schema = json_schema(r.response, components) if r.response is not None \
        else {"type": "object"}
    responses[ok_status] = {"description": "OK",
                            "content": {"application/json": {"schema": schema}}}
    statuses = set(r.errors)
    if r.auth:
        statuses.add(401)
    if "{" in r.path:
        statuses.add(404)  # an id that matches nothing, or is not a number
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": _STATUS_TEXT.get(status, "Error"),
            "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Error"}}},
        }
    return responses


def route_table_markdown(routes: Iterable[Any]) -> str:
    """The route table of docs/api.md (``python -m swarm_core.leader.openapi`` rewrites it)."""
    rows = ["| route | what | auth | body | response |", "| --- | --- | --- | --- | --- |"]
    for r in routes:
        auth = "fellow session" if r.fellow_session else ("token" if r.auth else "none")
        body = f"`{r.body.__name__}`" if r.body else ("multipart" if r.upload else "-")
        resp = f"`{r.response.__name__}`" if r.response else "-"
        rows.append(f"| `{r.method} {r.path}` | {r.summary} | {auth} | {body} | {resp} |")
    return "\n".join(rows) + "\n"


def _rewrite_api_doc(path: str = "docs/api.md") -> None:
    from pathlib import Path

    from swarm_core.leader.routes import ROUTES

    doc = Path(path)
    text = doc.read_text()
    start = text.index("| route | what |")
    end = text.index("\n\n", start) + 1
    doc.write_text(text[:start] + route_table_markdown(ROUTES) + text[end:])


if __name__ == "__main__":
    _rewrite_api_doc()
