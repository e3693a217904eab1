"""Faults during and after compile: SIGINT and SIGTERM leave nothing behind, a SIGKILLed compile's staging directory
is cleaned by the next compile, a full disk is one clear error with nothing written, and an artifact file
truncated, flipped or removed after compile is refused by load."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import save_checkpoint

import kiln.runtimes as kr
from kiln.cli import main
from kiln.errors import ArtifactError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("faults") / "bert", "bert", "base")


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.kiln-"))


def compile_until(ckpt: Path, out: Path, marker: str) -> subprocess.Popen:
    """Start ``kiln compile`` in a child process and return once its progress shows ``marker`` (mid-build).

    The child gets SIGINT's default action back: a shell without job control starts background commands (``make
    test &``) with SIGINT ignored, which the child would inherit, and Python then never raises KeyboardInterrupt."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "compile", str(ckpt), "-o", str(out), "--threads", "1"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if marker in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"compile never reached {marker!r}: {''.join(seen)[-2000:]}")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_mid_compile_leaves_nothing(ckpt, tmp_path, sig, code):
    out = tmp_path / "out"
    proc = compile_until(ckpt, out, "pass ")
    assert leftovers(tmp_path, "out"), "the compile should be building in its staging directory"
    proc.send_signal(sig)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == code, err
    assert f"interrupted ({signal.Signals(sig).name}); nothing written" in err and "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path, "out") == []


def test_sigkill_leftovers_are_cleaned_by_the_next_compile(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    proc = compile_until(ckpt, out, "pass ")
    proc.kill()
    proc.wait(30)
    stale = leftovers(tmp_path, "out")
    assert stale and str(proc.pid) in stale[0] and not out.exists()
    (tmp_path / ".other.kiln-tmp-1-x").mkdir()  # another output's: not ours to remove
    assert main(["compile", str(ckpt), "-o", str(out), "-q", "--threads", "1"]) == 0
    assert out.is_dir() and leftovers(tmp_path, "out") == [] and (tmp_path / ".other.kiln-tmp-1-x").is_dir()


def test_full_disk_is_one_clear_error_with_nothing_written(ckpt, tmp_path, capsys, monkeypatch):
    import onnx

    real = onnx.save_model

    def full(model, path, *a, **kw):  # the final graph write hits a full disk
        if "kiln-tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(model, path, *a, **kw)

    monkeypatch.setattr(onnx, "save_model", full)
    out = tmp_path / "out"
    assert main(["compile", str(ckpt), "-o", str(out), "-q", "--threads", "1"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and "No space left on device" in err[0] and "nothing was written" in err[0]
    assert not out.exists() and leftovers(tmp_path, "out") == []


def test_artifact_files_are_ordinary_files(artifacts):
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in artifacts["bert"].iterdir()}
    assert set(modes.values()) == {0o666 & ~mask}, modes


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove", "manifest"])
def test_damaged_artifact_is_refused_by_load(artifacts, tmp_path, damage):
    import shutil

    art = Path(shutil.copytree(artifacts["llama"], tmp_path / "a"))
    graph = art / "model.onnx"
    if damage == "truncate":
        graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    elif damage == "flip":
        data = bytearray(graph.read_bytes())
        data[len(data) // 3] ^= 0x01
        graph.write_bytes(bytes(data))
    elif damage == "remove":
        (art / "tokenizer.json").unlink()
    else:
        (art / "manifest.json").write_text((art / "manifest.json").read_text()[:100])
    with pytest.raises(ArtifactError, match="recompile"):
        kr.load(art)
