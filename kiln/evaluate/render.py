"""report.json, report.md and a self-contained report.html (plots as embedded PNG, no network, no script).

The page answers "which artifact do we ship?": it leads with the verdict table (one row per artifact: size, p50
latency and speed-up, the accuracy metrics of its kind, pass/fail against the gate thresholds naming the failing
metric), then the plots (accuracy against speed, per-layer error, error and latency distributions), then the
tables. report.md carries the same verdict table for CI job summaries and PR comments.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kiln.compiler.prune import span
from kiln.evaluate.fmt import metric, number, ratio

LABELS = {
    "ppl_reference": "perplexity, reference", "ppl_artifact": "perplexity, artifact",
    "ppl_increase_pct": "perplexity increase (%)", "top1_agreement": "next-token top-1 agreement",
    "kl_mean": "KL divergence, mean", "kl_p99": "KL divergence, p99", "greedy_match_rate": "greedy continuation match",
    "positions": "next-token positions", "cosine_min": "embedding cosine, min", "cosine_mean": "embedding cosine, mean",
    "cosine_p1": "embedding cosine, 1st percentile", "step_cosine_min": "step logits cosine, min",
    "steps": "decoder steps per text", "texts": "texts",
}


def size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# --- the verdict table -----------------------------------------------------------------------------------------
KIND_COLUMNS = {
    "decoder": [("ppl_increase_pct", "perplexity change"), ("top1_agreement", "top-1"), ("kl_mean", "KL mean"),
                ("greedy_match_rate", "greedy match")],
    "encoder": [("cosine_min", "cosine min"), ("cosine_mean", "cosine mean")],
    "seq2seq": [("top1_agreement", "top-1 per step"), ("kl_mean", "KL mean"), ("step_cosine_min", "step cosine min"),
                ("greedy_match_rate", "greedy match")],
}


def _limit(check: dict[str, Any]) -> str:
    from kiln.evaluate.gate import THRESHOLDS

    kind = THRESHOLDS[check["threshold"]][1]
    sign = "<=" if kind == "max" else ">="
    return f"{metric(check['metric'], check['value'])} (needs {sign} {metric(check['metric'], check['limit'])})"


def verdict_cell(entry: dict[str, Any]) -> str:
    v = entry.get("verdict") or {}
    if v.get("passed") is None:
        return "no thresholds"
    if v["passed"]:
        return "pass"
    bad = [c for c in v["checks"] if not c["passed"]]
    return "FAIL: " + "; ".join(f"{c['label'] if c['metric'].startswith('task:') else LABELS.get(c['metric'], c['metric'])} "
                                f"{_limit(c)}" for c in bad)


def task_cell(measured: dict[str, Any]) -> str:
    """An artifact's task metric with its drop against the reference and the drop's interval: 0.9125 (drop +0.0042,
    95% [-0.0083, +0.0167])."""
    lo, hi = measured["drop_interval"]
    return f"{number(measured['value'])} (drop {measured['drop']:+.4g}, 95% [{lo:+.4g}, {hi:+.4g}])"


def task_columns(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(set name, metric, column label) of every task metric the first artifact was measured on."""
    return [(t["name"], k, f"{k} ({t['name']})") for t in result["artifacts"][0].get("tasks", [])
            for k in t["metrics"]]


def _task(entry: dict[str, Any], name: str, key: str) -> str:
    for t in entry.get("tasks", []):
        if t["name"] == name and key in t["metrics"]:
            return task_cell(t["metrics"][key])
    return "-"


def task_rows(entry: dict[str, Any]) -> list[list[str]]:
    """One row per task metric: set, task, examples, artifact, reference, drop, its interval."""
    rows = []
    for t in entry.get("tasks", []):
        for k, m in t["metrics"].items():
            lo, hi = m["drop_interval"]
            rows.append([t["name"], t["task"], str(t["examples"]), k, number(m["value"]), number(m["reference"]),
                         f"{m['drop']:+.4g}" + (f" ({m['drop_pct']:+.2f}%)" if m.get("drop_pct") is not None else ""),
                         f"[{lo:+.4g}, {hi:+.4g}]"])
    return rows


TASK_HEADER = ["set", "task", "examples", "metric", "artifact", "reference", "drop", "95% interval of the drop"]


def verdict_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and one row of cells per artifact."""
    entries = result["artifacts"]
    kind = entries[0]["model"]["kind"]
    cols = KIND_COLUMNS.get(kind, [])
    tasks = task_columns(result)
    header = ["artifact", "precision", "size", "p50 latency", "speed-up", *[label for _, label in cols],
              *[label for _, _, label in tasks], "verdict"]
    rows = []
    for e in entries:
        m = e["metrics"]
        rows.append([e["name"], str(e["model"].get("precision")),
                     size(e["size_bytes"]), f"{e['latency']['p50_ms']:.2f} ms", ratio(e["speedup_vs_first"]),
                     *[metric(k, m[k]) if k in m else "-" for k, _ in cols],
                     *[_task(e, name, k) for name, k, _ in tasks], verdict_cell(e)])
    return header, rows


def _about(result: dict[str, Any]) -> list[str]:
    e0 = result["artifacts"][0]
    lat = e0["latency"]
    th = result.get("thresholds") or {}
    lines = [f"reference `{result['reference']}` on `{result['data']['path']}` ({result['data']['texts']} texts, "
             f"{result['data']['tokens']} tokens, the reference run once for all artifacts)",
             f"latency: {lat.get('what', 'one forward pass')}, batch {lat['shape'][0]} x {lat['shape'][1]} tokens, "
             f"{lat.get('rounds', 1)} alternating rounds; "
             f"speed-up against `{e0['name']}` (the first artifact), on {e0['measured_on']['backend']}",
             ("thresholds: " + ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}" for k, v in th.items()))
             if th else
             "thresholds: none found (kiln.toml [gate], pyproject.toml [tool.kiln.gate] or --config): no verdicts"]
    return lines


def verdict_text(result: dict[str, Any]) -> str:
    """The verdict table for the terminal."""
    header, rows = verdict_rows(result)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)) + "  " + header[-1]]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines)


# --- files -----------------------------------------------------------------------------------------------------
def write(result: dict[str, Any], errors: list[dict[str, list[np.ndarray]]], out: Path) -> None:
    """All three files are rendered before any is written, then moved in, so a failure leaves no half report."""
    files = {"report.json": json.dumps(result, indent=2) + "\n", "report.md": markdown(result),
             "report.html": page(result, plots(result, errors))}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        for name in files:
            os.replace(Path(tmp) / name, out / name)


def _metric_rows(entry: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(LABELS.get(k, k), metric(k, v)) for k, v in entry["metrics"].items()]
    lat = entry["latency"]
    rows.append((f"latency p50 / p90 / p99 (ms, batch x seq {lat['shape'][0]} x {lat['shape'][1]}, {lat['runs']} runs)",
                 f"{lat['p50_ms']:.3f} / {lat['p90_ms']:.3f} / {lat['p99_ms']:.3f}"))
    return rows


def markdown(result: dict[str, Any]) -> str:
    m = result["artifacts"][0]["model"]
    header, rows = verdict_rows(result)
    lines = [f"# kiln report: {m['architecture']} ({m['kind']}), {len(rows)} artifact(s)", ""]
    lines += [f"{line}  " for line in _about(result)] + [""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    for e in result["artifacts"]:
        lines += ["", f"## {e['name']} ({e['model'].get('precision')})", "", f"`{e['artifact']}`", "",
                  "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in _metric_rows(e)]
        if e.get("tasks"):
            lines += ["", "Task metrics (the reference checkpoint scored on the same examples; the drop is reference - "
                      "artifact, perplexity artifact - reference; paired bootstrap interval):", "",
                      "| " + " | ".join(TASK_HEADER) + " |", "|" + "---|" * len(TASK_HEADER)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in task_rows(e)]
        lines += ["", "| output | max abs err | mean abs err | p99 abs err |", "|---|---|---|---|"]
        lines += [f"| {n} | {number(s['max_abs'])} | {number(s['mean_abs'])} | {number(s['p99_abs'])} |"
                  for n, s in e["outputs"].items()]
        if e.get("pruning"):
            lines += ["", pruned_line(e["pruning"])]
        if e.get("layers"):
            kept = "heads" in e["layers"][0]
            lines += ["", "Where the error enters (each layer's output vs the artifact tensor carrying it):", "",
                      "| layer | relative error | artifact tensor |" + (" heads kept | FFN kept |" if kept else ""),
                      "|---|---|---|" + ("---|---|" if kept else "")]
            lines += [f"| {r['layer']} | {number(r['relative_error'])} | `{r['tensor']}` |"
                      + (f" {r.get('heads', '')} | {r.get('ffn', '')} |" if kept else "") for r in e["layers"]]
    return "\n".join(lines) + "\n"


def pruned_line(p: dict[str, Any]) -> str:
    """One sentence: what --prune removed per layer and what compile measured it cost on held-out text."""
    o = p.get("original", {})
    text = (f"Pruned ({p.get('method')}, {'adaptive' if p.get('adaptive') else 'uniform'} per-layer counts): heads "
            f"{o.get('heads', '?')} -> {span(p['heads_per_layer'])}, FFN channels {o.get('ffn', '?')} -> "
            f"{span(p['ffn_per_layer'])} per layer; against the original checkpoint the layer errors below are what "
            "pruning (and the precision) cost there")
    cost = p.get("compile_cost")
    if cost:
        text += "; compile measured " + ", ".join(f"{LABELS.get(k, k)} {v:.4g}" for k, v in cost.items() if k != "texts")
        text += f" on {cost.get('texts')} held-out texts"
    return text + "."


# --- plots -----------------------------------------------------------------------------------------------------
def _figure(width: float = 6.5, height: float = 3.2) -> tuple[Any, Any]:
    """A figure on its own Agg canvas: pyplot (and with it the process-wide backend) is never touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _names(result: dict[str, Any]) -> list[str]:
    return [e["name"] for e in result["artifacts"]]


def scatter(result: dict[str, Any]) -> tuple[str, str]:
    """Accuracy against speed, one point per artifact (red: fails its thresholds)."""
    entries = result["artifacts"]
    kind = entries[0]["model"]["kind"]
    decoder = kind == "decoder"
    key, label = {"decoder": ("ppl_increase_pct", "perplexity change (%)"),
                  "seq2seq": ("top1_agreement", "step top-1 agreement")}.get(kind, ("cosine_min", "embedding cosine, min"))
    fig, ax = _figure()
    for name, e in zip(_names(result), entries):
        y = e["metrics"].get(key)
        if y is None:
            continue
        passed = (e.get("verdict") or {}).get("passed")
        color = "tab:red" if passed is False else "tab:green" if passed else "tab:blue"
        ax.scatter([e["speedup_vs_first"]], [y], color=color, s=40, zorder=3)
        ax.annotate(name, (e["speedup_vs_first"], y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if decoder and any(e["metrics"].get(key, 0) > 0 for e in entries):
        ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel(f"speed-up vs {_names(result)[0]} (p50)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    return "accuracy against speed (green: passes, red: fails, blue: no thresholds)", _png(fig)


def plots(result: dict[str, Any], errors: list[dict[str, list[np.ndarray]]]) -> list[tuple[str, str]]:
    """(title, base64 PNG): the scatter, per-layer error, error distributions, latency, KL per position."""
    out = [scatter(result)]
    names = _names(result)
    entries = result["artifacts"]
    if any(e.get("layers") for e in entries):
        fig, ax = _figure()
        for name, e in zip(names, entries):
            layers = e.get("layers") or []
            if layers:
                ax.plot([r["layer"] for r in layers], [max(r["relative_error"], 1e-12) for r in layers], marker="o",
                        label=name)
        ax.set_yscale("log")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("relative error of the layer's output")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out.append(("where the error enters: per-layer error, one line per artifact", _png(fig)))
    outputs = sorted({n for errs in errors for n in errs})
    for output in outputs:
        fig, ax = _figure()
        for name, errs in zip(names, errors):
            if output in errs:
                err = np.concatenate(errs[output])
                ax.hist(np.log10(np.maximum(err, 1e-12)), bins=60, histtype="step", label=name)
        ax.set_xlabel(f"log10 |artifact - reference| of {output}")
        ax.set_ylabel("elements")
        ax.legend(fontsize=8)
        out.append((f"absolute error of {output}", _png(fig)))
    fig, ax = _figure(height=max(1.6, 0.6 * len(names) + 0.8))
    for i, e in enumerate(entries):  # drawn by hand: Axes.boxplot imports pyplot, which a library must not
        p5, p25, p50, p75, p95 = np.percentile(e["latency"]["samples_ms"], [5, 25, 50, 75, 95])
        ax.hlines(i, p5, p95, color="0.4")
        ax.barh(i, p75 - p25, left=p25, height=0.5, color="tab:blue", alpha=0.35, edgecolor="tab:blue")
        ax.vlines(p50, i - 0.25, i + 0.25, color="tab:orange", linewidth=2)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms per run (orange p50, box p25-p75, line p5-p95)")
    out.append(("latency distributions", _png(fig)))
    fig, ax = _figure()
    for name, e in zip(names, entries):
        if "kl_per_position" in e:
            ax.plot(e["kl_per_position"], label=name)
        elif "cosine_per_text" in e:
            ax.plot(sorted(e["cosine_per_text"]), marker=".", label=name)
    decoder = "kl_per_position" in entries[0]
    seq2seq = entries[0]["model"]["kind"] == "seq2seq"
    ax.set_xlabel("decoder step" if seq2seq else "position" if decoder else "text (sorted)")
    ax.set_ylabel("mean KL(reference || artifact)" if decoder else "embedding cosine")
    ax.legend(fontsize=8)
    out.append(("KL divergence per decoder step" if seq2seq else "KL divergence per position" if decoder
                else "embedding cosine per text", _png(fig)))
    return out


# --- the page --------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f"<td class=\"{'fail' if c.startswith('FAIL') else 'pass' if c == 'pass' else ''}\">{esc(c)}</td>" for c in r)
        + "</tr>" for r in rows)
    return f"<table class=\"{cls}\"><tr>{head}</tr>{body}</table>"


def _details(e: dict[str, Any]) -> str:
    esc = html.escape
    parts = [f"<h3>{esc(e['name'])} ({esc(str(e['model'].get('precision')))})</h3>",
             f"<p><code>{esc(e['artifact'])}</code></p>",
             _table(["metric", "value"], [list(r) for r in _metric_rows(e)]),
             _table(["output", "max abs err", "mean abs err", "p99 abs err"],
                    [[n, number(s["max_abs"]), number(s["mean_abs"]), number(s["p99_abs"])]
                     for n, s in e["outputs"].items()])]
    if e.get("tasks"):
        parts.append("<p>Task metrics: the reference checkpoint scored on the same examples; the drop is reference - "
                     "artifact (perplexity: artifact - reference), with its paired bootstrap interval.</p>")
        parts.append(_table(TASK_HEADER, task_rows(e)))
    if e.get("pruning"):
        parts.append(f"<p>{esc(pruned_line(e['pruning']))}</p>")
    if e.get("layers"):
        kept = "heads" in e["layers"][0]
        parts.append("<p>Where the error enters: each layer's output against the artifact tensor carrying it.</p>")
        parts.append(_table(["layer", "relative error", "artifact tensor"] + (["heads kept", "FFN kept"] if kept else []),
                            [[str(r["layer"]), number(r["relative_error"]), r["tensor"]]
                             + ([str(r.get("heads", "")), str(r.get("ffn", ""))] if kept else []) for r in e["layers"]]))
    return "".join(parts)


def page(result: dict[str, Any], images: list[tuple[str, str]]) -> str:
    esc = html.escape
    m = result["artifacts"][0]["model"]
    header, rows = verdict_rows(result)
    about = "".join(f"<p class=\"about\">{esc(line).replace('`', '')}</p>" for line in _about(result))
    figs = "".join(f"<figure><img alt=\"{esc(t)}\" src=\"data:image/png;base64,{b}\"><figcaption>{esc(t)}</figcaption>"
                   "</figure>" for t, b in images)
    details = "".join(_details(e) for e in result["artifacts"])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kiln report: {esc(str(m['architecture']))}</title>
<style>body{{font-family:sans-serif;max-width:72em;margin:2em auto;padding:0 1em;color:#222}}
table{{border-collapse:collapse;margin:.5em 0 1em}}td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left}}
th{{background:#f3f3f3}}table.verdict td{{white-space:nowrap}}table.verdict td.fail{{white-space:normal;max-width:28em}}td.pass{{color:#176b2c;font-weight:bold}}td.fail{{color:#a31515;font-weight:bold}}
table.verdict td,table.verdict th{{font-size:1.05em}}p.about{{margin:.2em 0;color:#555}}
figure{{display:inline-block;margin:.5em 1em .5em 0;vertical-align:top}}figcaption{{font-size:.9em;color:#555}}
img{{max-width:100%}}</style></head>
<body><h1>kiln report: {esc(str(m['architecture']))} ({esc(str(m['kind']))}), {len(rows)} artifact(s)</h1>
<h2>Verdict</h2>{_table(header, rows, "verdict")}{about}
<h2>Plots</h2>{figs}
<h2>Details</h2>{details}
</body></html>
"""
