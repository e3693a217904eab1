"""``make typecheck``: mypy over kiln's TensorRT modules against the public ``tensorrt-stubs`` (no GPU, no TensorRT).

    python tools/typecheck.py [--stubs-version 10.13.0.35.1]

The stubs wheel is downloaded without its dependencies (they pull NVIDIA's library wheels, which install only
from NVIDIA's index) and unpacked into ``.typecheck/stubs`` for ``MYPYPATH``, not installed: installed, its bare
``tensorrt`` directory would make ``import tensorrt`` succeed without a library behind it. Generated from the
bindings, the stubs name four plugin parameters ``in`` (a keyword: a syntax error), renamed ``in_`` here, one
method lists a required parameter after defaulted ones (its defaults are dropped), and they import
``tensorrt_libs`` (the library wheel), given an empty stub.
"""

from __future__ import annotations

import argparse
import ast
import glob
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["kiln/runtimes/tensorrt.py", "kiln/runtimes/engines.py", "kiln/runtimes/cuda.py"]


def stubs(version: str, work: Path) -> Path:
    out = work / f"stubs-{version}"
    if (out / "tensorrt_bindings" / "tensorrt.pyi").is_file():
        return out
    work.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check", "-d",
                    str(work), f"tensorrt-stubs=={version}"], check=True)
    wheel = glob.glob(str(work / f"tensorrt_stubs-{version}-*.whl"))[0]
    zipfile.ZipFile(wheel).extractall(out)
    for pyi in out.rglob("*.pyi"):
        pyi.write_text("\n".join(repair(line) for line in pyi.read_text().splitlines()) + "\n")
    (out / "tensorrt_libs.pyi").write_text("")
    return out


def repair(line: str) -> str:
    """One stub line made valid Python: keyword parameter names renamed, and where a parameter without a default
    follows defaulted ones (``add_scale_nd``), the defaults dropped."""
    line = re.sub(r"([(,]\s*)in(\s*:)", r"\1in_\2", line)
    stripped = line.strip()
    if not stripped.startswith("def ") or not stripped.endswith(":"):
        return line
    try:
        ast.parse(stripped + " ...")
    except SyntaxError:
        return re.sub(r"\s*=\s*[^,()]+(?=[,)])", "", line)
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stubs-version", default="10.13.0.35.1")
    args = p.parse_args()
    path = stubs(args.stubs_version, ROOT / ".typecheck")
    config = ROOT / ".typecheck" / "mypy.ini"  # errors inside the generated stubs are theirs, not kiln's
    config.write_text("[mypy]\nfollow_imports = silent\npython_version = 3.10\n"
                      + "".join(f"[mypy-{m}]\nignore_errors = True\n"
                                for m in ("tensorrt", "tensorrt.*", "tensorrt_bindings", "tensorrt_bindings.*")))
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(config), *MODULES]
    print(f"$ MYPYPATH={path.relative_to(ROOT)} mypy {' '.join(MODULES)}")
    return subprocess.run(cmd, cwd=ROOT, env={"MYPYPATH": str(path), "PATH": "/usr/bin:/bin"}).returncode


if __name__ == "__main__":
    sys.exit(main())
