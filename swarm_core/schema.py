"""Structuring untrusted JSON into attrs classes, with errors that name the field.

One converter for the whole project: request bodies on the leader, responses in the client and
(later) experiment configs all go through :func:`structure`, so a bad field reads the same
everywhere: ``<path>: <what was expected>``.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import types
import typing
from collections.abc import Iterator
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

T = TypeVar("T")
# Persisted rows are only ever attrs records, which is what lets attrs.fields() inspect them.
A = TypeVar("A", bound=attrs.AttrsInstance)


class SchemaError(ValueError):
    """Input did not match a schema. ``field`` is a JSON path such as ``$.link.tx_mbps``."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class FieldError(ValueError):
    """Raised by attrs validators; ``structure`` turns it into a SchemaError with a path."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


_INT64 = (-(2**63), 2**63 - 1)


def _strict_int(value: Any, _t: type) -> int:
    # bool is an int in Python; in an API body it is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {_json_type(value)}")
    # The documented range (OpenAPI says int64), and what SQLite and orjson can hold: orjson
    # parses up to 2**64 - 1, which would fail later, half applied, as a 500.
    if not _INT64[0] <= value <= _INT64[1]:
        raise TypeError("expected an integer between -2**63 and 2**63-1")
    return value


def _strict_float(value: Any, _t: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {_json_type(value)}")
    f = float(value)
    if f != f or f in (float("inf"), float("-inf")):
        raise TypeError("expected a finite number")
    return f


def _strict_str(value: Any, _t: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {_json_type(value)}")
    return value


def _strict_bool(value: Any, _t: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _strict_str_enum(value: Any, t: type[enum.StrEnum]) -> enum.StrEnum:
    # (Registered for StrEnum itself: the str hook would otherwise take these, unchecked.)
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {_json_type(value)}")
    try:
        return t(value)
    except ValueError:
        raise ValueError("expected one of " + ", ".join(repr(m.value) for m in t)) from None


def _structure_dict(value: Any, _t: type) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {_json_type(value)}")
    return value


def _make_converter(forbid_extra_keys: bool) -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=forbid_extra_keys, detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(enum.StrEnum, _strict_str_enum)
    conv.register_structure_hook_func(
        lambda t: t is dict or (typing.get_origin(t) is dict and typing.get_args(t)[1] is Any),
        _structure_dict,
    )

    def _list_hook_factory(t: Any) -> Any:
        (item_type,) = typing.get_args(t) or (Any,)

        def hook(value: Any, _t: Any) -> list[Any]:
            if not isinstance(value, list):
                raise TypeError(f"expected a list, got {_json_type(value)}")
            out = []
            errors = []
            for i, item in enumerate(value):
                try:
                    out.append(conv.structure(item, item_type))
                except Exception as exc:
                    exc.__notes__ = [*getattr(exc, "__notes__", []), f"Structuring index {i}"]
                    errors.append(exc)
            if errors:
                raise IterableValidationError(
                    "While structuring a list", errors, t
                )
            return out

        return hook

    conv.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is list, _list_hook_factory
    )

    def _attrs_hook_factory(t: Any) -> Any:
        inner = make_dict_structure_fn(t, conv, **_renames(t))

        def hook(value: Any, _t: Any) -> Any:
            # Else a nested list or number fails with "'list' object has no attribute 'keys'".
            if not isinstance(value, dict):
                raise TypeError(f"expected an object, got {_json_type(value)}")
            return inner(value, _t)

        return hook

    conv.register_structure_hook_factory(attrs.has, _attrs_hook_factory)
    conv.register_unstructure_hook_factory(
        lambda t: attrs.has(t) and bool(_renames(t) or getattr(t, "__sparse__", False)),
        lambda t: _sparse_unstructure(make_dict_unstructure_fn(t, conv, **_renames(t)))
        if getattr(t, "__sparse__", False) else make_dict_unstructure_fn(t, conv, **_renames(t)))
    return conv


# {class name: {attribute: JSON key}}, so that errors name the key, not the attribute.
_RENAMED: dict[str, dict[str, str]] = {}


def _renames(cls: Any) -> dict[str, Any]:
    """A class's ``__renames__`` ({attribute: JSON key}, for keys that are Python keywords) as
    cattrs overrides."""
    renames = getattr(cls, "__renames__", {})
    if renames:
        _RENAMED[cls.__name__] = dict(renames)
    return {a: override(rename=k) for a, k in renames.items()}


def _sparse_unstructure(inner: Any) -> Any:
    def hook(obj: Any) -> dict[str, Any]:
        return {k: v for k, v in inner(obj).items() if v is not None}

    return hook


def sparse(cls: type[T]) -> type[T]:
    """Class decorator: unstructure without the fields that are None, so a figure a reporter
    did not have is absent from the JSON rather than null."""
    # A marker the converter's getattr reads; no class declares it, so mypy cannot know it.
    cls.__sparse__ = True  # type: ignore[attr-defined]
    return cls


converter = _make_converter(forbid_extra_keys=True)
# Responses from a newer leader may carry fields this client does not know yet.
lenient_converter = _make_converter(forbid_extra_keys=False)


def _first_error(exc: BaseException, path: str) -> tuple[str, str]:
    """Walk cattrs' exception groups to the first leaf; return (path, message)."""
    if isinstance(exc, ForbiddenExtraKeysError):
        keys = ", ".join(sorted(exc.extra_fields))
        return path, f"unknown field(s): {keys}"
    if isinstance(exc, ClassValidationError | IterableValidationError):
        for sub in exc.exceptions:
            notes = getattr(sub, "__notes__", [])
            sub_path = path
            for note in notes:
                note = str(note)
                if note.startswith("Structuring class") and "@ attribute" in note:
                    head, attr = note.rsplit("@ attribute", 1)
                    owner = head.removeprefix("Structuring class").strip()
                    attr = attr.strip()
                    sub_path = f"{path}.{_RENAMED.get(owner, {}).get(attr, attr)}"
                elif note.startswith("Structuring index"):
                    sub_path = f"{path}[{note.rsplit(' ', 1)[1]}]"
                elif note.startswith("Structuring mapping"):  # (a value, or its key)
                    sub_path = f"{path}.{note.split('@ key', 1)[1].strip()[1:-1]}"
            return _first_error(sub, sub_path)
        return path, str(exc)
    if isinstance(exc, KeyError):
        name = exc.args[0] if exc.args else "?"
        return f"{path}.{name}" if not path.endswith(f".{name}") else path, "required field missing"
    if isinstance(exc, FieldError):
        return (f"{path}.{exc.field}" if exc.field else path), str(exc)
    if " not in literal " in str(exc):
        options = str(exc).split("Literal[", 1)[-1].rstrip("]")
        return path, f"expected one of {options}"
    if isinstance(exc, ValueError) and not str(exc):
        return path, "invalid value"
    if isinstance(exc, TypeError) and "__init__() missing" in str(exc):
        return path, "required field missing"
    if isinstance(exc, ValueError) and "is not a valid" in str(exc):
        return path, str(exc)
    return path, str(exc) or type(exc).__name__


_trust = threading.Lock()
_trusting = 0


@contextlib.contextmanager
def trusted() -> Iterator[None]:
    """Within: build objects from what this system wrote itself (its stored rows, the leader's
    replies) without the range and consistency checks, which are for what comes in: a rule
    added since must not make a stored job, or a list of jobs, unreadable. Types are still
    checked. (attrs' switch is process-wide; the count keeps overlapping users from turning
    the checks back on under each other.)"""
    global _trusting
    with _trust:
        _trusting += 1
        attrs.validators.set_disabled(True)
    try:
        yield
    finally:
        with _trust:
            _trusting -= 1
            if not _trusting:
                attrs.validators.set_disabled(False)


def checking() -> bool:
    """Whether range and consistency checks run (not inside :func:`trusted`); for checks made
    in ``__attrs_post_init__``, which attrs' switch does not cover."""
    return not attrs.validators.get_disabled()


def structure(data: Any, cls: type[T], root: str = "$", *, strict: bool = True,
              trust: bool = False) -> T:
    """Structure ``data`` into ``cls`` or raise :class:`SchemaError` naming the field.

    ``strict`` refuses unknown keys (request bodies, configs); responses use ``strict=False``.
    ``trust`` (what this system wrote itself) skips the range and consistency checks and
    ignores unknown keys.
    """
    if trust:
        with trusted():
            return structure(data, cls, root, strict=False)
    if attrs.has(cls) and not isinstance(data, dict):
        raise SchemaError(f"expected an object, got {_json_type(data)}", root)
    conv = converter if strict else lenient_converter
    try:
        return conv.structure(data, cls)
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        path, message = _first_error(exc, root)
        raise SchemaError(message, path) from None
    except FieldError as exc:
        raise SchemaError(str(exc), f"{root}.{exc.field}" if exc.field else root) from None
    except (TypeError, ValueError, KeyError) as exc:
        path, message = _first_error(exc, root)
        raise SchemaError(message, path) from None


def unstructure(obj: Any) -> Any:
    return converter.unstructure(obj)


# --- JSON Schema, for the OpenAPI document -----------------------------------------------------


def _validators(v: Any) -> list[Any]:
    if v is None:
        return []
    inner = getattr(v, "_validators", None)  # attrs' and_()
    if inner is not None:
        return [x for i in inner for x in _validators(i)]
    return [v]


LIMITS = ("minimum", "maximum", "maxLength")


def _check_documented_limits(cls: type, f: attrs.Attribute, schema: dict[str, Any]) -> None:
    """A limit a field's metadata states must be one its validators enforce (and carry into
    the document): a limit written only in the metadata would be a promise the leader does
    not keep."""
    for key in LIMITS:
        stated = f.metadata.get(key)
        if stated is not None and schema.get(key) != stated:
            raise TypeError(f"{cls.__name__}.{f.name}: metadata states {key}={stated!r}, "
                            f"its validators enforce {schema.get(key)!r}")


def json_schema(tp: Any, components: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema for ``tp``; attrs classes go into ``components`` and are referenced."""
    if tp is Any or tp is typing.Any:
        return {}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        inner = [json_schema(a, components) for a in non_none]
        schema: dict[str, Any] = inner[0] if len(inner) == 1 else {"anyOf": inner}
        if len(non_none) != len(args):
            schema = {**schema, "nullable": True} if "$ref" not in schema else {
                "allOf": [schema], "nullable": True}
        return schema
    if origin is typing.Literal:
        return {"type": "string", "enum": list(args)}
    if origin is list:
        return {"type": "array", "items": json_schema(args[0] if args else Any, components)}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # (tuple[X, ...]: a list)
        return {"type": "array", "items": json_schema(args[0], components)}
    if origin is dict or tp is dict:
        if len(args) == 2 and args[1] is not Any:
            return {"type": "object", "additionalProperties": json_schema(args[1], components)}
        return {"type": "object"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        # orjson reads 64-bit integers; the document says so.
        return {"type": "integer", "minimum": _INT64[0], "maximum": _INT64[1]}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if attrs.has(tp):
        name = tp.__name__
        if name not in components:
            components[name] = {}  # placeholder against recursion
            hints = typing.get_type_hints(tp)
            props = {}
            required = []
            renames = getattr(tp, "__renames__", {})
            for f in attrs.fields(tp):
                key = renames.get(f.name, f.name)
                props[key] = json_schema(hints[f.name], components)
                for v in _validators(f.validator):
                    extra = getattr(v, "json_schema", None)
                    if extra and "$ref" not in props[key]:
                        props[key].update(extra)
                _check_documented_limits(tp, f, props[key])
                if f.metadata.get("doc"):
                    if "$ref" in props[key]:  # (OpenAPI 3.0 ignores a $ref's siblings)
                        props[key] = {"allOf": [props[key]]}
                    props[key]["description"] = f.metadata["doc"]
                if f.default is attrs.NOTHING:
                    required.append(key)
            comp: dict[str, Any] = {
                "type": "object",
                "properties": props,
                "additionalProperties": False,
            }
            if required:
                comp["required"] = required
            comp.update(getattr(tp, "__json_schema__", {}))
            if tp.__doc__:
                comp["description"] = " ".join(tp.__doc__.strip().split("\n\n")[0].split())
            components[name] = comp
        return {"$ref": f"#/components/schemas/{name}"}
    raise TypeError(f"no JSON schema for {tp!r}")


def structure_persisted(row: dict[str, Any], cls: type[A]) -> A:
    """Rebuild a record from its stored fields; fields marked ``transient`` take defaults.

    Stored rows were written by us, so unknown keys (from a newer leader) are ignored and the
    range checks do not run again (see :func:`trusted`).
    """
    hints = typing.get_type_hints(cls)
    with trusted():
        kwargs = {
            f.name: lenient_converter.structure(row[f.name], hints[f.name])
            for f in attrs.fields(cls)
            if not f.metadata.get("transient") and f.name in row
        }
        return cls(**kwargs)
