"""Validation of repaired output against the schema the request declared. Pure.

Validators come from jsonschema-rs (compiled in Rust) and are cached by a hash of the
canonical schema, so a tenant sending the same schema on every call compiles it once.
Problems are short sentences naming the JSON path, worded so a model can fix them:
`unknown field 'foo' at $`, `missing required field 'name' at $.user`.

Gemini's OpenAPI-subset schemas (`"type": "OBJECT"`, `nullable`, `property_ordering`)
are normalised to JSON Schema first by `normalize_schema`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import jsonschema_rs
import orjson

__all__ = ["SchemaError", "describe", "normalize_schema", "problems", "schema_key"]

_CACHE_SIZE = 512
_cache: dict[str, Any] = {}
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "any_of")
_SUBSCHEMA_ONE = (
    "additionalProperties",
    "not",
    "contains",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_GEMINI_ONLY = ("property_ordering", "propertyOrdering", "nullable", "example")
_NUMERIC = frozenset(
    (
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "minProperties",
        "maxProperties",
        "min_items",
        "max_items",
        "min_length",
        "max_length",
    )
)
_SNAKE = {"any_of": "anyOf", "min_items": "minItems", "max_items": "maxItems"}
_SNAKE |= {"min_length": "minLength", "max_length": "maxLength"}
_IDENT = re.compile(r"[A-Za-z_$][\w$]*")


class SchemaError(ValueError):
    """The schema itself could not be compiled; the output cannot be judged."""


def schema_key(schema: dict[str, Any]) -> str:
    """sha256 of the schema's canonical JSON (sorted keys)."""
    return hashlib.sha256(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)).hexdigest()


def problems(value: Any, schema: dict[str, Any]) -> list[str]:
    """Every way `value` violates `schema`, one sentence each; `[]` when it conforms.

    Fails closed: a validator that raises while judging, or an error it reports that
    cannot be read, still counts as a problem, never as a conforming value."""
    validator = _validator(schema)
    found: list[str] = []
    try:
        for error in validator.iter_errors(value):
            found.extend(describe(error))
    except Exception as exc:  # the library could not judge this value: that is not "valid"
        found.append(f"the value could not be checked against the schema ({type(exc).__name__}: {exc})")
    return found


def _validator(schema: dict[str, Any]) -> Any:
    key = schema_key(schema)
    validator = _cache.get(key)
    if validator is None:
        try:
            validator = jsonschema_rs.validator_for(normalize_schema(schema))
        except Exception as exc:  # jsonschema-rs raises several types for a bad schema
            raise SchemaError(f"the schema could not be compiled: {exc}") from exc
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[key] = validator
    return validator


def describe(error: Any) -> list[str]:
    """One sentence per problem in a jsonschema-rs ValidationError; never empty, so an error
    whose shape this code does not know still counts (its message, else its type)."""
    try:
        at = json_path(error.instance_path)
    except Exception:
        at = "$"
    kind = getattr(error, "kind", None)
    if isinstance(kind, jsonschema_rs.ValidationErrorKind.AdditionalProperties):
        return [f"unknown field {name!r} at {at}" for name in kind.unexpected]
    if isinstance(kind, jsonschema_rs.ValidationErrorKind.Required):
        return [f"missing required field {kind.property!r} at {at}"]
    message = getattr(error, "message", None)
    if not isinstance(message, str) or not message:
        message = f"the value does not match the schema ({type(error).__name__})"
    return [f"{message} at {at}"]


def json_path(parts: Any) -> str:
    """`$`, `$.user.name`, `$.items[2]`, `$["odd key"]`."""
    out = ["$"]
    for p in parts:
        if isinstance(p, int):
            out.append(f"[{p}]")
        elif _IDENT.fullmatch(p):
            out.append(f".{p}")
        else:
            out.append(f"[{orjson.dumps(p).decode()}]")
    return "".join(out)


def normalize_schema(schema: Any) -> Any:
    """Gemini's OpenAPI subset as JSON Schema: lower-case types, `nullable` as a type
    union, Gemini-only keys dropped, numeric strings as numbers. JSON Schema input comes
    back equal (the function is idempotent)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _GEMINI_ONLY:
            continue
        key = str(_SNAKE.get(key, key))
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: normalize_schema(v) for k, v in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [normalize_schema(v) for v in value]
        elif key == "items":
            items = [normalize_schema(v) for v in value] if isinstance(value, list) else value
            out[key] = normalize_schema(items) if isinstance(items, dict) else items
        elif key in _SUBSCHEMA_ONE:
            out[key] = normalize_schema(value)
        elif key == "type":
            out[key] = [_lower(t) for t in value] if isinstance(value, list) else _lower(value)
        elif key in _NUMERIC and isinstance(value, str) and value.isdigit():
            out[key] = int(value)
        else:
            out[key] = value
    if schema.get("nullable") is True and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"] if "null" not in types else types
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    return out


def _lower(t: Any) -> Any:
    return t.lower() if isinstance(t, str) else t
