"""MkDocs hooks: pages generated from the code at build time, so they cannot drift from it.

- ``docs/cli.md``'s marker: every subcommand of kiln's own argument parser, its usage and an option table;
- ``docs/artifact.md``'s marker: the manifest's JSON Schema (``kiln/runtimes/manifest.schema.json``, the one ``load``
  validates against) as a field table, and the schema itself."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

MARKER = "<!-- kiln-cli-reference -->"
SCHEMA_MARKER = "<!-- kiln-manifest-schema -->"
SCHEMA = Path(__file__).resolve().parents[1] / "kiln" / "runtimes" / "manifest.schema.json"


def _cell(text: object) -> str:
    return str(text).replace("|", "&#124;").replace("\n", " ")  # a bare pipe would split the table cell


def _option_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.choices is not None:
        what = ", ".join(f"`{c}`" for c in action.choices)
    elif action.nargs == 0:
        what = "flag"
    else:
        what = f"`{action.metavar or action.dest.upper()}`"
    default = action.default
    shown = "" if default in (None, argparse.SUPPRESS, False, []) or action.nargs == 0 else f"`{default}`"
    return f"| {names} | {_cell(what)} | {_cell(shown)} | {_cell(action.help or '')} |"


def _command(name: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    level = "##" if " " not in name else "###"
    out = [f"{level} kiln {name}", "", summary[:1].upper() + summary[1:] + ".", "", "```", parser.format_usage().strip(),
           "```", ""]
    rows = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if rows:
        out += ["| option | takes | default | what it does |", "|---|---|---|---|"]
        out += [_option_row(a) for a in rows]
        out.append("")
    for inner in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        helps = {c.dest: c.help or "" for c in inner._choices_actions}
        for sub_name, sub_parser in inner.choices.items():
            out += _command(f"{name} {sub_name}", sub_parser, helps.get(sub_name, ""))
    return out


def reference() -> str:
    os.environ["COLUMNS"] = "88"  # argparse wraps usage lines to the terminal; fix the width for the page
    from kiln.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| [`kiln {n}`](#kiln-{n}) | {_cell(helps.get(n, ''))} |" for n in sub.choices]
    lines.append("")
    for name, p in sub.choices.items():
        lines += _command(name, p, helps.get(name, ""))
    return "\n".join(lines)


def _type(node: dict, defs: dict) -> str:
    if "$ref" in node:
        return _type(defs[node["$ref"].split("/")[-1]], defs)
    if "enum" in node:
        return "one of " + ", ".join(f"`{json.dumps(e)}`" for e in node["enum"])
    if "anyOf" in node:
        return " or ".join(_type(o, defs) for o in node["anyOf"])
    kinds = node.get("type", "any")
    text = " or ".join(kinds) if isinstance(kinds, list) else kinds
    limits = [f"{k} {node[k]}" for k in ("minimum", "minLength", "minItems") if k in node]
    if "pattern" in node:
        limits.append(f"matching `{node['pattern']}`")
    return text + (f" ({', '.join(limits)})" if limits else "")


def _fields(node: dict, defs: dict, prefix: str, required: set[str]) -> list[str]:
    rows = []
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        target = defs[sub["$ref"].split("/")[-1]] if "$ref" in sub else sub
        mark = " (required)" if name in required else ""
        rows.append(f"| `{path}`{mark} | {_cell(_type(sub, defs))} | {_cell(target.get('description', ''))} |")
        if "properties" in target:
            rows += _fields(target, defs, path + ".", set(target.get("required", ())))
        items = target.get("items")
        if isinstance(items, dict):
            inner = defs[items["$ref"].split("/")[-1]] if "$ref" in items else items
            if "properties" in inner:
                rows += _fields(inner, defs, path + "[].", set(inner.get("required", ())))
    return rows


def manifest_reference() -> str:
    schema = json.loads(SCHEMA.read_text())
    defs = schema.get("$defs", {})
    lines = [schema["description"], "", "| field | type | what it holds |", "|---|---|---|"]
    lines += _fields(schema, defs, "", set(schema.get("required", ())))
    lines += ["", "The schema itself (`kiln/runtimes/manifest.schema.json`, JSON Schema draft 2020-12):", "",
              "```json", json.dumps(schema, indent=2), "```"]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, reference())
    if SCHEMA_MARKER in markdown:
        markdown = markdown.replace(SCHEMA_MARKER, manifest_reference())
    return markdown
