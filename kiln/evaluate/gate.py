"""``kiln gate``: thresholds against a report.json; exit 0 when all hold, 1 when any is violated, 2 when
the report, the baseline or the thresholds cannot be used.

Thresholds come from, in increasing priority: ``[tool.kiln.gate]`` in ./pyproject.toml, ``[gate]`` in
./kiln.toml (or the file given with ``--config``, either layout), then command-line flags.
Reads JSON and TOML only: no torch, so a CI job can gate without the compile dependencies.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

REPORT_SCHEMA = "kiln-report"
REPORT_VERSIONS = (1, 2)
MAX_REPORT_BYTES = 64 << 20
"""1: one artifact, its metrics and latency at the top level; 2: a comparison, one entry per artifact."""

# threshold -> (report metric, "max" or "min", label)
THRESHOLDS: dict[str, tuple[str, str, str]] = {
    "max_ppl_increase_pct": ("ppl_increase_pct", "max", "perplexity increase (%)"),
    "min_top1_agreement": ("top1_agreement", "min", "next-token top-1 agreement"),
    "max_kl_mean": ("kl_mean", "max", "mean KL divergence"),
    "min_cosine": ("cosine_min", "min", "embedding cosine, min"),
    "max_latency_regression_pct": ("latency_regression_pct", "max", "p50 latency regression vs baseline (%)"),
}

# Task metrics (``kiln report --eval``), per evaluation set: the artifact's value, its drop against the reference
# checkpoint (absolute, and in % of the reference's value). Metric keys read "task:METRIC:FIELD".
TASK_METRICS = {"accuracy": "accuracy", "f1": "f1_macro", "entity_f1": "entity_f1", "exact_match": "exact_match",
                "bleu": "bleu", "chrf": "chrf", "rouge1": "rouge1", "rouge2": "rouge2", "rouge_l": "rouge_l"}
for _short, _metric in TASK_METRICS.items():
    THRESHOLDS[f"min_{_short}"] = (f"task:{_metric}:value", "min", _metric)
    THRESHOLDS[f"max_{_short}_drop"] = (f"task:{_metric}:drop", "max", f"{_metric} drop")
    THRESHOLDS[f"max_{_short}_drop_pct"] = (f"task:{_metric}:drop_pct", "max", f"{_metric} drop (%)")
THRESHOLDS["max_perplexity"] = ("task:perplexity:value", "max", "perplexity")
THRESHOLDS["max_perplexity_increase"] = ("task:perplexity:drop", "max", "perplexity increase")
THRESHOLDS["max_perplexity_increase_pct"] = ("task:perplexity:drop_pct", "max", "perplexity increase (%)")

GATE_ON = ("value", "upper")
"""How task thresholds read a measurement: its value, or the pessimistic end of its bootstrap interval ("upper":
a drop's upper bound, a minimum's lower bound, a maximum's upper bound)."""


def _toml() -> Any:
    """tomllib (Python 3.11+) or its backport tomli, declared for 3.10 in pyproject.toml."""
    if sys.version_info >= (3, 11):
        import tomllib  # novermin (3.11+ only, guarded above)

        return tomllib
    try:
        import tomli
    except ImportError as e:
        raise GateInputError("reading kiln.toml / pyproject.toml on Python 3.10 needs tomli (pip install tomli), "
                             "or pass thresholds as flags") from e
    return tomli


class GateInputError(KilnError):
    """A report, baseline or threshold file kiln gate cannot use (exit 2)."""

    exit_code = 2


def number(value: Any) -> bool:
    """A finite int or float (JSON's true is not 1, and Infinity / NaN are never measurements)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Check:
    name: str
    label: str
    threshold: float
    value: float
    kind: str

    @property
    def passed(self) -> bool:
        return self.value <= self.threshold if self.kind == "max" else self.value >= self.threshold


def load_report(path: str | Path, role: str = "report") -> dict[str, Any]:
    p = Path(path)
    try:
        if not p.is_file():
            raise GateInputError(f"{role} {p} does not exist or is not a file; give the report.json that kiln report "
                                 "wrote")
        if p.stat().st_size > MAX_REPORT_BYTES:
            raise GateInputError(f"{role} {p} is larger than {MAX_REPORT_BYTES >> 20} MiB, which no kiln report is; "
                                 "give the report.json that kiln report wrote")
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GateInputError(f"{role} {p} is not valid JSON ({e}); give the report.json that kiln report wrote") from e
    except RecursionError as e:
        raise GateInputError(f"{role} {p} nests its JSON too deeply to be a kiln report; regenerate it with kiln "
                             "report") from e
    except OSError as e:
        raise GateInputError(f"{role} {p} cannot be read ({e.strerror or e}); give the report.json that kiln report "
                             "wrote") from e
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA or (
            type(data.get("schema_version")) is not int or data["schema_version"] not in REPORT_VERSIONS):
        raise GateInputError(f"{role} {p} is not a kiln report (schema {REPORT_SCHEMA} version "
                             f"{'/'.join(map(str, REPORT_VERSIONS))}); regenerate it with kiln report")
    if not entries(data):
        raise GateInputError(f"{role} {p} lacks its metrics or latency section; regenerate it with kiln report")
    return data


def entries(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured artifacts of a report: one for version 1, one per artifact for version 2 (empty when a
    section is missing)."""
    found = report.get("artifacts") if report.get("schema_version", 1) >= 2 else [report]
    if not isinstance(found, list) or not found:
        return []
    ok = all(isinstance(e, dict) and isinstance(e.get("metrics"), dict) and isinstance(e.get("latency"), dict)
             and isinstance(e.get("artifact", ""), str) for e in found)
    return found if ok else []


def pick(report: dict[str, Any], artifact: str | None, role: str = "report") -> list[dict[str, Any]]:
    """The entries to gate: all of them, or the one ``artifact`` names (its path, or its directory name)."""
    found = entries(report)
    if artifact is None:
        return found
    wanted = Path(artifact)
    hits = [e for e in found if Path(e.get("artifact", "")) == wanted.absolute()
            or Path(e.get("artifact", "")).resolve() == wanted.resolve()]
    if not hits:
        hits = [e for e in found if Path(e.get("artifact", "")).name == wanted.name]
    if len(hits) != 1:
        names = ", ".join(str(e.get("artifact")) for e in found)
        raise GateInputError(f"--artifact {artifact} is {'ambiguous' if hits else 'not'} in the {role} (it measured "
                             f"{names}); give one of those paths")
    return hits


def baseline_for(entry: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """The baseline entry to compare ``entry``'s latency with: the one of the same artifact name, or the only one."""
    found = entries(baseline)
    name = Path(entry.get("artifact", "")).name
    same = [e for e in found if Path(e.get("artifact", "")).name == name]
    if len(same) == 1 or len(found) == 1:
        return (same or found)[0]
    raise GateInputError(f"the baseline measured {len(found)} artifacts and none is named {name}; pass a baseline "
                         "report of this artifact")


def _table(path: Path, data: dict[str, Any]) -> dict[str, Any] | None:
    if path.name == "pyproject.toml":
        return data.get("tool", {}).get("kiln", {}).get("gate")
    return data.get("gate", data.get("tool", {}).get("kiln", {}).get("gate"))


def load_thresholds(config: str | Path | None, flags: dict[str, Any], cwd: Path | None = None) -> dict[str, Any]:
    """Merge thresholds: pyproject.toml, then kiln.toml or ``config``, then flags (later wins). Numbers, and
    ``gate_on`` ("value" or "upper") where task thresholds should read their intervals' pessimistic end."""
    cwd = cwd or Path.cwd()
    files = [cwd / "pyproject.toml", Path(config) if config else cwd / "kiln.toml"]
    merged: dict[str, Any] = {}
    for f in files:
        if not f.is_file():
            if config and f == Path(config):
                raise GateInputError(f"--config {config} does not exist; give a TOML file with a [gate] table")
            continue
        toml = _toml()
        try:
            table = _table(f, toml.loads(f.read_text()))
        except (toml.TOMLDecodeError, UnicodeDecodeError) as e:
            raise GateInputError(f"{f} is not valid TOML ({e}); fix it or pass thresholds as flags") from e
        if table is None:
            if config and f == Path(config):
                raise GateInputError(f"--config {config} has no [gate] table; add one, e.g. [gate] min_top1_agreement = 0.99")
            continue
        if not isinstance(table, dict):
            raise GateInputError(f"{f}: the gate table is not a table of thresholds")
        for key, value in table.items():
            if key == "gate_on":
                if value not in GATE_ON:
                    raise GateInputError(f"{f}: gate_on = {value!r}; give \"value\" or \"upper\"")
                merged[key] = value
                continue
            if key not in THRESHOLDS:
                raise GateInputError(f"{f}: unknown threshold {key!r}; known: {', '.join(THRESHOLDS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GateInputError(f"{f}: threshold {key} = {value!r} is not a finite number")
            merged[key] = float(value)
    for key, value in flags.items():
        if key == "gate_on":
            if value is not None and value not in GATE_ON:
                raise GateInputError(f"--gate-on {value}: give value or upper")
            continue
        if value is not None and not math.isfinite(value):
            raise GateInputError(f"--{key.replace('_', '-')} {value}: give a finite number")
    merged.update({k: (v if k == "gate_on" else float(v)) for k, v in flags.items() if v is not None})
    if not any(k != "gate_on" for k in merged):
        raise GateInputError("no thresholds: add a [gate] table to kiln.toml (or [tool.kiln.gate] to pyproject.toml), "
                             "pass --config FILE, or give flags such as --min-top1-agreement 0.99")
    return merged


def applies(key: str, entry: dict[str, Any]) -> bool:
    """Whether threshold ``key`` has something to read in a report entry (a task threshold: some set has its metric)."""
    metric = THRESHOLDS[key][0]
    if metric.startswith("task:"):
        return any(metric.split(":")[1] in (t.get("metrics") or {}) for t in tasks_of(entry))
    return metric in entry.get("metrics", {})


def tasks_of(entry: dict[str, Any]) -> list[dict[str, Any]]:
    found = entry.get("tasks") or []
    return [t for t in found if isinstance(t, dict) and isinstance(t.get("metrics"), dict)] if isinstance(found, list) else []


def task_reading(measured: dict[str, Any], field: str, kind: str, gate_on: str, where: str) -> float:
    """The number a task threshold compares: the field, or its interval's pessimistic end with gate_on = upper."""
    if field == "drop_pct":
        ref, drop = measured.get("reference"), measured.get("drop")
        if not number(ref) or not number(drop) or ref == 0:
            raise GateInputError(f"{where} has no usable reference value for a relative drop; regenerate it with kiln report")
        if gate_on == "upper":
            drop = _bound(measured, "drop_interval", 1, where)
        return 100.0 * drop / abs(ref)
    value = measured.get(field)
    if gate_on == "upper":
        value = _bound(measured, "drop_interval" if field == "drop" else "interval",
                       1 if field == "drop" or kind == "max" else 0, where)
    if not number(value):
        raise GateInputError(f"{where}: {field} is {json.dumps(value)[:40]}, not a finite number; regenerate the report "
                             "with kiln report")
    return float(value)


def _bound(measured: dict[str, Any], key: str, end: int, where: str) -> float:
    interval = measured.get(key)
    if not isinstance(interval, list) or len(interval) != 2 or not all(number(v) for v in interval):
        raise GateInputError(f"{where} has no bootstrap {key} for gate_on = \"upper\"; regenerate it with kiln report")
    return float(interval[end])


def evaluate(report: dict[str, Any], thresholds: dict[str, Any], baseline: dict[str, Any] | None = None,
             report_path: str = "report") -> list[Check]:
    values = dict(report["metrics"])
    gate_on = thresholds.get("gate_on", "value")
    if baseline is not None:
        base, now = baseline["latency"].get("p50_ms"), report["latency"].get("p50_ms")
        if not number(base) or not number(now) or base <= 0:
            raise GateInputError("the report or the baseline has no usable latency p50_ms; regenerate them with kiln report")
        values["latency_regression_pct"] = 100.0 * (now / base - 1.0)
    checks = []
    for key, threshold in thresholds.items():
        if key == "gate_on":
            continue
        metric, kind, label = THRESHOLDS[key]
        if metric.startswith("task:"):
            _, name, field = metric.split(":")
            found = [t for t in tasks_of(report) if name in t["metrics"]]
            if not found:
                raise GateInputError(f"{report_path} has no evaluation set measuring {name} (needed by {key}); run kiln "
                                     "report with --eval on such a set, or remove the threshold")
            for t in found:
                where = f"{report_path}: {t.get('name', 'an evaluation set')}"
                if not isinstance(t["metrics"][name], dict):
                    raise GateInputError(f"{where}: {name} is not a measurement; regenerate the report with kiln report")
                reading = task_reading(t["metrics"][name], field, kind, gate_on, where)
                bound = " (interval bound)" if gate_on == "upper" else ""
                checks.append(Check(key, f"{label}{bound}, {str(t.get('name', '?'))[:40]}", threshold, reading, kind))
            continue
        if metric == "latency_regression_pct" and baseline is None:
            raise GateInputError(f"{key} compares against a baseline; pass --baseline LAST_RELEASE/report.json")
        value = values.get(metric)
        if value is None:
            kind = (report.get("model") or {}).get("kind") if isinstance(report.get("model"), dict) else None
            raise GateInputError(f"{report_path} has no {metric} (needed by {key}); this threshold does not apply to "
                                 f"a {kind if isinstance(kind, str) else 'different'} report, remove it")
        if not number(value):  # Infinity, NaN, true, "0.99": never a pass
            raise GateInputError(f"{report_path}: {metric} is {json.dumps(value)[:40]}, not a finite number; "
                                 "regenerate the report with kiln report")
        checks.append(Check(key, label, threshold, float(value), kind))
    return checks


def table(checks: list[Check]) -> str:
    from kiln.evaluate.fmt import metric

    lines = [f"{'metric':<60} {'threshold':>12} {'value':>12}  verdict"]
    for c in checks:
        key = THRESHOLDS[c.name][0]
        bound = ("<= " if c.kind == "max" else ">= ") + metric(key, c.threshold)
        lines.append(f"{c.label:<60} {bound:>12} {metric(key, c.value):>12}  {'pass' if c.passed else 'FAIL'}")
    return "\n".join(lines)
