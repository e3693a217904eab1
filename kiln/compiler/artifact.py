"""Writing an artifact: everything goes into a temporary sibling directory that is renamed into
place only once it is complete, so a failed or interrupted compile never leaves a half artifact."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import UsageError


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
