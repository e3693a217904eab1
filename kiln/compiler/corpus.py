"""Text the user hands kiln (INT8 calibration, ``kiln report --data``) and the default text every
machine has (the English sentences of the Python docs), plus the held-out split by content hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import UsageError


def read_texts(path: str | None, role: str = "calibration file") -> list[str]:
    """Lines of a text file, or the "text" field of a JSONL file; default: English sentences of the Python docs."""
    if path is None:
        import pydoc_data.topics as topics

        raw = " ".join(topics.topics.values()).replace("\n", " ").split(". ")
        return [t.strip() for t in raw if 40 < len(t.strip()) < 300][:400]
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{role} {path} does not exist; give a text file (one text per line) or JSONL")
    lines = [line.strip() for line in p.read_text(errors="replace").splitlines() if line.strip()]
    if p.suffix == ".jsonl":
        try:
            lines = [str(json.loads(line)["text"]) for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"{role} {path}: every JSONL line needs a \"text\" field ({e})") from e
    if not lines:
        raise UsageError(f"{role} {path} has 0 usable texts; give at least a few lines of text")
    return lines


def split(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(calibration, held-out): a text is held out when its hash falls in the last quarter."""
    cal, held = [], []
    for t in texts:
        (held if hashlib.sha256(t.encode()).digest()[0] >= 192 else cal).append(t)
    if not cal or not held:
        cal, held = list(texts[: max(1, 3 * len(texts) // 4)]), list(texts[3 * len(texts) // 4:]) or list(texts)
    return cal, held
