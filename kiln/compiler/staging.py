"""Writing an artifact: everything goes into a temporary sibling directory that is renamed into
place only once it is complete, so a failed or interrupted compile never leaves a half artifact; and the files
the staged directory receives besides the graphs (the tokenizer's)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.errors import UsageError

GRAPH = "model.onnx"
"""The graph file of a single-graph artifact (encoder-decoders: ``trace_seq2seq.ENCODER`` / ``DECODER``)."""
CHAT_TEMPLATE = "chat_template.jinja"
"""The tokenizer's chat template, in the artifact: ``kiln generate --chat`` and ``kiln serve`` render it."""


def check_output(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise UsageError(f"output {output} already exists; choose another -o or pass --force to replace it")
    if output.exists() and not output.is_dir():
        raise UsageError(f"output {output} exists and is not a directory; remove it or choose another -o")
    if not output.parent.exists():
        raise UsageError(f"the parent directory of output {output} does not exist; create {output.parent} first")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale(output: Path) -> list[Path]:
    """Remove staging directories a killed compile (SIGKILL, power loss) left beside ``output``: ours by name
    (``.NAME.kiln-tmp-PID-*``, ``.NAME.kiln-old-PID-*``) and their process gone. Returns what was removed."""
    removed = []
    for kind in ("tmp", "old"):
        for d in output.parent.glob(f".{output.name}.kiln-{kind}-*-*"):
            pid = d.name[len(f".{output.name}.kiln-{kind}-"):].split("-", 1)[0]
            if d.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staging(output: Path, force: bool) -> Iterator[Path]:
    """Yield an empty directory beside ``output``; on success it becomes ``output``, on error (or SIGINT/SIGTERM,
    which the CLI turns into exceptions) it vanishes. A SIGKILLed compile's directory is removed by the next
    compile to the same output (``clean_stale``)."""
    check_output(output, force)
    clean_stale(output)
    pid = os.getpid()
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.kiln-tmp-{pid}-"))
    try:
        yield tmp
        mask = _umask()
        tmp.chmod(0o777 & ~mask)  # mkdtemp makes it private; an artifact is an ordinary directory
        for f in tmp.rglob("*"):  # and its files ordinary files (ONNX writes external data 0600)
            if f.is_file():
                f.chmod(0o666 & ~mask)
        if output.exists():
            old = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.kiln-old-{pid}-"))
            output.replace(old / "artifact")
            tmp.replace(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.replace(output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def copy_tokenizer(ckpt: Any, root: Path) -> None:
    """The checkpoint's tokenizer files into the staged artifact (``tokenizer.json`` always, saved from the loaded
    fast tokenizer; the chat template as its own file)."""
    if ckpt.tokenizer is None:
        return
    for name in ckpt.tokenizer_files:
        if name != "tokenizer.json":
            shutil.copy2(ckpt.path / name, root / name)
    # Saved from the loaded fast tokenizer, so checkpoints that ship only vocab files get one too.
    ckpt.tokenizer.backend_tokenizer.save(str(root / "tokenizer.json"))
    template = getattr(ckpt.tokenizer, "chat_template", None)
    if isinstance(template, str):  # from tokenizer_config.json or chat_template.jinja, whichever it came in
        (root / CHAT_TEMPLATE).write_text(template)
