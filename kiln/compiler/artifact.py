"""Writing an artifact: everything goes into a temporary sibling directory that is renamed into
place only once it is complete, so a failed or interrupted compile never leaves a half artifact."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from kiln.errors import UsageError
from kiln.runtimes.artifact import MANIFEST, sha256_file

_TOOLS = ("kiln", "torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "numpy", "tokenizers")


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _TOOLS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def write_manifest(root: Path, data: dict[str, Any]) -> None:
    """Write ``manifest.json`` with the sha256 of every other file in ``root``."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    data = dict(data, files={p.relative_to(root).as_posix(): sha256_file(p) for p in files})
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(root / MANIFEST)


def check_output(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise UsageError(f"output {output} already exists; choose another -o or pass --force to replace it")
    if output.exists() and not output.is_dir():
        raise UsageError(f"output {output} exists and is not a directory; remove it or choose another -o")
    if not output.parent.exists():
        raise UsageError(f"the parent directory of output {output} does not exist; create {output.parent} first")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staging(output: Path, force: bool) -> Iterator[Path]:
    """Yield an empty directory beside ``output``; on success it becomes ``output``, on error it vanishes."""
    check_output(output, force)
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.kiln-tmp-"))
    try:
        yield tmp
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; an artifact is an ordinary directory
        if output.exists():
            old = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.kiln-old-"))
            output.replace(old / "artifact")
            tmp.replace(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.replace(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
