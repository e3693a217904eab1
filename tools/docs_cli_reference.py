"""MkDocs hook: the CLI reference page is generated from kiln's own argument parser at build time, so it cannot
drift from the code. ``docs/cli.md`` holds the marker below; every subcommand gets its usage and an option table."""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- kiln-cli-reference -->"


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


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown
