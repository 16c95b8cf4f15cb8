"""JSON on the control plane: orjson everywhere, one place for the options."""

from __future__ import annotations

from typing import Any

import orjson

_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def dumps(obj: Any, *, pretty: bool = False) -> bytes:
    return orjson.dumps(obj, option=_OPTS | (orjson.OPT_INDENT_2 if pretty else 0))


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


JSONDecodeError = orjson.JSONDecodeError
