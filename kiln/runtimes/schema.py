"""The manifest's JSON Schema (``manifest.schema.json``, draft 2020-12) and a validator for the part of JSON Schema
it uses: ``type``, ``enum``, ``required``, ``properties``, ``additionalProperties``, ``items``, ``anyOf``, ``$ref``
into ``$defs``, ``minimum`` / ``maximum``, ``minLength`` / ``maxLength``, ``minItems`` / ``maxItems``, ``minProperties`` /
``maxProperties``, ``pattern``.

Written here rather than taken from the ``jsonschema`` package: the runtime installs with numpy and onnxruntime
alone (an edge app), and this is all the manifest needs. The tests check it against ``jsonschema`` itself on every
artifact they compile and on mutated manifests. It reports the first violation, with the path to it."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("manifest.schema.json")

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_HANDLED = {"$schema", "$id", "$defs", "title", "description", "type", "enum", "required", "properties",
            "additionalProperties", "items", "anyOf", "$ref", "minimum", "minLength", "minItems", "minProperties",
            "pattern", "maximum", "maxLength", "maxItems", "maxProperties"}


@cache
def manifest_schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA_FILE.read_text())
    unknown = sorted(_keywords(schema) - _HANDLED)
    if unknown:  # a keyword this validator would silently ignore
        raise ValueError(f"{SCHEMA_FILE} uses {', '.join(unknown)}, which kiln.runtimes.schema does not check")
    return schema


def _keywords(node: Any, in_properties: bool = False) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_keywords(n) for n in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    own = set() if in_properties else set(node)
    inner = set()
    for key, value in node.items():
        if key in ("enum", "required", "description", "title", "pattern"):
            continue
        inner |= _keywords(value, in_properties=key in ("properties", "$defs") and not in_properties)
    return own | inner


def _where(path: tuple) -> str:
    """``a.b[0]``; a key that is not a plain printable name is quoted and escaped (a mutated manifest's key may hold
    a newline or megabytes), so the error stays one short line."""
    def step(p: Any) -> str:
        if isinstance(p, int):
            return f"[{p}]"
        if p.isprintable() and len(p) <= 40 and not any(c in p for c in ' []"'):
            return f".{p}"
        return f"[{json.dumps(p[:40])}]"

    return "".join(step(p) for p in path).lstrip(".") or "the manifest"


def first_error(value: Any, schema: dict[str, Any] | None = None) -> str | None:
    """The first place ``value`` breaks ``schema`` (default: the manifest's), as one line, or None."""
    root = schema if schema is not None else manifest_schema()
    return _check(value, root, root, ())


def _check(v: Any, s: dict[str, Any], root: dict[str, Any], path: tuple) -> str | None:
    if "$ref" in s:
        name = s["$ref"].removeprefix("#/$defs/")
        return _check(v, root["$defs"][name], root, path)
    where = _where(path)
    types = s.get("type")
    if types is not None:
        wanted = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](v) for t in wanted):
            return f"{where} is {json.dumps(v)[:40]}, not {' or '.join(wanted)}"
    if "enum" in s and not any(v == e and type(v) is type(e) for e in s["enum"]):
        return f"{where} is {json.dumps(v)[:40]}, not one of {', '.join(json.dumps(e) for e in s['enum'])}"
    if "anyOf" in s and all(_check(v, option, root, path) for option in s["anyOf"]):
        return f"{where} is {json.dumps(v)[:40]}, which fits none of its allowed forms"
    if _TYPES["number"](v) and "minimum" in s and v < s["minimum"]:
        return f"{where} is {v}, below the minimum {s['minimum']}"
    if _TYPES["number"](v) and "maximum" in s and v > s["maximum"]:
        return f"{where} is {v}, above the maximum {s['maximum']}"
    if isinstance(v, str):
        if len(v) < s.get("minLength", 0):
            return f"{where} is empty"
        if len(v) > s.get("maxLength", len(v)):
            return f"{where} is {len(v)} characters long, more than {s['maxLength']}"
        if "pattern" in s and not re.search(s["pattern"], v):
            return f"{where} {v[:40]!r} does not match {s['pattern']}"
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0):
            return f"{where} has {len(v)} entries, fewer than {s['minItems']}"
        if len(v) > s.get("maxItems", len(v)):
            return f"{where} has {len(v)} entries, more than {s['maxItems']}"
        if "items" in s:
            for i, item in enumerate(v):
                problem = _check(item, s["items"], root, path + (i,))
                if problem:
                    return problem
    if isinstance(v, dict):
        if len(v) < s.get("minProperties", 0):
            return f"{where} is empty"
        if len(v) > s.get("maxProperties", len(v)):
            return f"{where} has {len(v)} fields, more than {s['maxProperties']}"
        missing = [k for k in s.get("required", ()) if k not in v]
        if missing:
            return f"{where} lacks {', '.join(missing)}"
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for key, item in v.items():
            sub = props.get(key, extra)
            if sub is False:
                return f"{_where(path + (key,))} is not a field this schema version knows"
            if isinstance(sub, dict):
                problem = _check(item, sub, root, path + (key,))
                if problem:
                    return problem
    return None
