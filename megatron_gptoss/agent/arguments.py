"""Checking a tool call's arguments against the tool's JSON schema, with a message the model can act on.

The subset of JSON Schema tool descriptions use: `type` (one or a list), `properties`, `required`,
`additionalProperties` (true / false / a schema), `items`, `enum`, `const`, `minimum` / `maximum`,
`minLength` / `maxLength`, `minItems` / `maxItems`, `anyOf` / `oneOf`. Other keywords are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is(value: Any, name: str) -> bool:
    if name in ("number", "integer") and isinstance(value, bool):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(name, (object,)))


def check_arguments(schema: Mapping[str, Any] | None, value: Any, where: str = "arguments") -> str | None:
    """None when `value` satisfies `schema` (None: no arguments expected, any object passes), else the
    first problem, naming where in the arguments it is."""
    if schema is None:
        return None if isinstance(value, dict) else f"{where} must be a JSON object"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is(value, t) for t in names):
            return f"{where} must be of type {' or '.join(names)}, got {type(value).__name__} {value!r:.80}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {value!r:.80}"
    if "const" in schema and value != schema["const"]:
        return f"{where} must be {schema['const']!r}, got {value!r:.80}"
    for keyword in ("anyOf", "oneOf"):
        if keyword in schema:
            problems = [check_arguments(s, value, where) for s in schema[keyword]]
            if all(p is not None for p in problems):
                return f"{where} matches none of its alternatives ({problems[0]})"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{where} must be >= {schema['minimum']}, got {value}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{where} must be <= {schema['maximum']}, got {value}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{where} must have at least {schema['minLength']} characters"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{where} must have at most {schema['maxLength']} characters"
    if isinstance(value, list):
        return _check_array(schema, value, where)
    if isinstance(value, dict):
        return _check_object(schema, value, where)
    return None


def _check_array(schema: Mapping[str, Any], value: list, where: str) -> str | None:
    if len(value) < schema.get("minItems", 0):
        return f"{where} must have at least {schema['minItems']} items"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        return f"{where} must have at most {schema['maxItems']} items"
    items = schema.get("items")
    if isinstance(items, Mapping):
        for i, item in enumerate(value):
            problem = check_arguments(items, item, f"{where}[{i}]")
            if problem is not None:
                return problem
    return None


def _check_object(schema: Mapping[str, Any], value: dict, where: str) -> str | None:
    props = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name not in value:
            return f"{where} is missing the required property {name!r}"
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in props:
            problem = check_arguments(props[name], item, f"{where}.{name}")
        elif extra is False:
            problem = f"{where} has an unknown property {name!r}; known: {sorted(props)}"
        elif isinstance(extra, Mapping):
            problem = check_arguments(extra, item, f"{where}.{name}")
        else:
            problem = None
        if problem is not None:
            return problem
    return None
