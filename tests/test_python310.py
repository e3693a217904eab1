"""pyproject declares requires-python >= 3.10: kiln must not use what 3.10 lacks (tomllib is 3.11+)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_source_needs_nothing_past_python_310():
    """vermin reads every module's syntax and imports; a 3.11-only name fails here (guarded ones say so)."""
    vermin = Path(sys.executable).with_name("vermin")  # the console script (the package has no __main__)
    out = subprocess.run([str(vermin), "--no-tips", "--eval-annotations", "-t=3.10-",
                          "--violations", str(ROOT / "kiln")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cli_starts_without_tomllib():
    """Every kiln command builds its parser first; that must not need tomllib."""
    code = "import sys; sys.modules['tomllib'] = None; from kiln.cli import main; sys.exit(main(['gate', '--help']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "--min-cosine" in out.stdout, out.stderr


@pytest.fixture()
def as_python_310(monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))


def _report(tmp_path: Path) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"schema": "kiln-report", "schema_version": 1, "model": {"kind": "encoder"},
                                "metrics": {"cosine_min": 0.999}, "latency": {"p50_ms": 1.0}}))
    return path


def test_gate_on_310_with_flags_needs_no_toml(as_python_310, tmp_path, monkeypatch, capsys):
    from kiln.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tomli", None)
    assert main(["gate", str(_report(tmp_path)), "--min-cosine", "0.99"]) == 0


def test_gate_on_310_reads_toml_through_tomli(as_python_310, tmp_path, monkeypatch, capsys):
    import tomllib

    from kiln.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kiln.toml").write_text("[gate]\nmin_cosine = 0.9999\n")
    monkeypatch.setitem(sys.modules, "tomli", tomllib)  # the backport has the same API
    assert main(["gate", str(_report(tmp_path))]) == 1
    assert "min_cosine" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tomli", None)  # not installed: a clear usage error, not a crash
    assert main(["gate", str(_report(tmp_path))]) == 2
    assert "needs tomli" in capsys.readouterr().err
