"""report.json, report.md and a self-contained report.html (plots as embedded PNG, no network)."""

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

LABELS = {
    "ppl_reference": "perplexity, reference", "ppl_artifact": "perplexity, artifact",
    "ppl_increase_pct": "perplexity increase (%)", "top1_agreement": "next-token top-1 agreement",
    "kl_mean": "KL divergence, mean", "kl_p99": "KL divergence, p99", "greedy_match_rate": "greedy continuation match",
    "positions": "next-token positions", "cosine_min": "embedding cosine, min", "cosine_mean": "embedding cosine, mean",
    "cosine_p1": "embedding cosine, 1st percentile",
}


def write(result: dict[str, Any], errors: dict[str, list[np.ndarray]], out: Path) -> None:
    """All three files are rendered before any is written, then moved in, so a failure leaves no half report."""
    files = {"report.json": json.dumps(result, indent=2) + "\n", "report.md": markdown(result),
             "report.html": page(result, plots(result, errors))}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        for name in files:
            os.replace(Path(tmp) / name, out / name)


def _rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(LABELS.get(k, k), f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in result["metrics"].items()]
    lat = result["latency"]
    rows.append((f"latency p50 / p90 / p99 (ms, batch x seq {lat['shape'][0]} x {lat['shape'][1]}, {lat['runs']} runs)",
                 f"{lat['p50_ms']:.3f} / {lat['p90_ms']:.3f} / {lat['p99_ms']:.3f}"))
    return rows


def markdown(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [f"# kiln report: {m['architecture']} ({m['kind']}, {m['precision']})", "",
             f"artifact `{result['artifact']}` vs reference `{result['reference']}` on `{result['data']['path']}` "
             f"({result['data']['texts']} texts, {result['data']['tokens']} tokens)", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _rows(result)]
    lines += ["", "| output | max abs err | mean abs err | p99 abs err |", "|---|---|---|---|"]
    lines += [f"| {n} | {s['max_abs']:.4g} | {s['mean_abs']:.4g} | {s['p99_abs']:.4g} |" for n, s in result["outputs"].items()]
    if result.get("pruning"):
        lines += ["", pruned_line(result["pruning"])]
    if result.get("layers"):
        kept = "heads" in result["layers"][0]
        lines += ["", "Where the error enters (each layer's output vs the artifact tensor carrying it):", "",
                  "| layer | relative error | artifact tensor |" + (" heads kept | FFN kept |" if kept else ""),
                  "|---|---|---|" + ("---|---|" if kept else "")]
        lines += [f"| {r['layer']} | {r['relative_error']:.3g} | `{r['tensor']}` |"
                  + (f" {r.get('heads', '')} | {r.get('ffn', '')} |" if kept else "") for r in result["layers"]]
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


def _figure() -> tuple[Any, Any]:
    """A figure on its own Agg canvas: pyplot (and with it the process-wide backend) is never touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plots(result: dict[str, Any], errors: dict[str, list[np.ndarray]]) -> list[tuple[str, str]]:
    """(title, base64 PNG) for the error histograms, KL per position (or cosine per text), latency."""
    out = []
    for name, parts in errors.items():
        err = np.concatenate(parts)
        fig, ax = _figure()
        ax.hist(np.log10(np.maximum(err, 1e-12)), bins=60)
        ax.set_xlabel("log10 |artifact - reference|")
        ax.set_ylabel("elements")
        out.append((f"absolute error of {name}", _png(fig)))
    fig, ax = _figure()
    if "kl_per_position" in result:
        ax.plot(result["kl_per_position"])
        ax.set_xlabel("position")
        ax.set_ylabel("mean KL(reference || artifact)")
        title = "KL divergence per position"
    else:
        ax.plot(sorted(result["cosine_per_text"]), marker=".")
        ax.set_xlabel("text (sorted)")
        ax.set_ylabel("embedding cosine")
        title = "embedding cosine per text"
    out.append((title, _png(fig)))
    fig, ax = _figure()
    ax.hist(result["latency"]["samples_ms"], bins=40)
    ax.set_xlabel("ms per run")
    ax.set_ylabel("runs")
    out.append(("latency distribution", _png(fig)))
    return out


def page(result: dict[str, Any], images: list[tuple[str, str]]) -> str:
    esc = html.escape
    m = result["model"]
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in _rows(result))
    outs = "".join(f"<tr><td>{esc(n)}</td><td>{s['max_abs']:.4g}</td><td>{s['mean_abs']:.4g}</td><td>{s['p99_abs']:.4g}</td></tr>"
                   for n, s in result["outputs"].items())
    kept = bool(result.get("layers")) and "heads" in result["layers"][0]
    layers = "".join(f"<tr><td>{r['layer']}</td><td>{r['relative_error']:.3g}</td><td><code>{esc(r['tensor'])}</code></td>"
                     + (f"<td>{r.get('heads', '')}</td><td>{r.get('ffn', '')}</td>" if kept else "") + "</tr>"
                     for r in result.get("layers", []))
    pruned = f"<p>{esc(pruned_line(result['pruning']))}</p>" if result.get("pruning") else ""
    figs = "".join(f"<figure><img alt=\"{esc(t)}\" src=\"data:image/png;base64,{b}\"><figcaption>{esc(t)}</figcaption></figure>"
                   for t, b in images)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kiln report: {esc(m['architecture'] or '')}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}figure{{display:inline-block;margin:1em}}</style></head>
<body><h1>kiln report: {esc(str(m['architecture']))} ({esc(str(m['kind']))}, {esc(str(m['precision']))})</h1>
<p>artifact <code>{esc(result['artifact'])}</code> vs reference <code>{esc(result['reference'])}</code> on
<code>{esc(result['data']['path'])}</code> ({result['data']['texts']} texts, {result['data']['tokens']} tokens)</p>
<table><tr><th>metric</th><th>value</th></tr>{rows}</table>
<h2>Outputs</h2><table><tr><th>output</th><th>max abs err</th><th>mean abs err</th><th>p99 abs err</th></tr>{outs}</table>
<h2>Where the error enters</h2><p>Each layer's output against the artifact tensor carrying it (relative error).</p>{pruned}
<table><tr><th>layer</th><th>relative error</th><th>artifact tensor</th>{"<th>heads kept</th><th>FFN kept</th>" if kept else ""}</tr>{layers}</table>
<h2>Plots</h2>{figs}
</body></html>
"""
