"""Does a prompt's answer depend on what runs beside it? Greedy completions of each prompt alone against the same
prompt inside a batch, on the machine at hand, through every path a user runs.

    python tools/batch_invariance.py [ARTIFACT] [--prompts 16] [--batch 4] [--tokens 32] [--threads 2]

Without ARTIFACT: SmolLM2-135M-Instruct at kiln's default INT4 (compiled once into ~/.cache/kiln/load-serve, as
tools/load_serve.py does). Each prompt (a chat request) is generated alone with ``Model.generate`` (the path of an
edge app, ``kiln generate`` and ``kiln serve --decode threads``), then in batches of ``--batch`` prompts:

- ``Model.generate``: a row of the cache per prompt, as continuous batching runs it (``generation.row_steps``);
- the left-padded batch through one cache of shared length (``generation.steps``: how ``Model.generate`` ran
  batches before, and how it still runs them on a backend without per-row lengths);
- the scheduler (``kiln serve``'s continuous batching), the batch's prompts submitted together;
- where the canary made a lone prompt decode beside an idle row (``min_rows`` 2), each prompt alone at one row.

Prints the machine line, the canary's verdict and the rows a lone prompt decodes at (``min_rows``), then per path the
completions equal to the prompt alone, the earliest step where one differs, and tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import kiln.runtimes as kr  # noqa: E402
from kiln.runtimes.canary import machine_line  # noqa: E402
from kiln.runtimes.generation import as_prompt, row_policy, row_steps, steps  # noqa: E402
from kiln.runtimes.sampling import Sampling  # noqa: E402
from kiln.runtimes.scheduler import Scheduler  # noqa: E402
from load_serve import TOPICS, smollm2_artifact  # noqa: E402


def padded(model: kr.Model, rows: list[list[int]], tokens: int) -> np.ndarray:
    """The batch left-padded through one cache whose rows share a length (the path before per-row decoding)."""
    prompt = as_prompt(rows, None, 0)
    seqs = None
    for seqs in steps(model.runtime, model.manifest.data, prompt, tokens, Sampling(), [], 0, None):
        pass
    assert seqs is not None
    return seqs


def one_row(model: kr.Model, row: list[int], tokens: int) -> list[int]:
    """The prompt alone at one row (M = 1) whatever the canary said: what the fallback to two rows avoids."""
    prompt = as_prompt([row], None, 0)
    seqs = None
    for seqs in row_steps(model.runtime, model.manifest.data, prompt, tokens, Sampling(), [], 0, None, 1,
                          row_policy(model.manifest.data, None)[1]):
        pass
    assert seqs is not None
    return seqs[0, len(row):].tolist()


def divergence(got: list[int], want: list[int]) -> int | None:
    """The first step at which two completions differ (None: equal)."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None if len(got) == len(want) else 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", nargs="?")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    art = Path(args.artifact) if args.artifact else smollm2_artifact(
        Path.home() / ".cache" / "kiln" / "load-serve", "int4", args.threads)
    with kr.load(art, threads=args.threads) as model:
        data = model.manifest.data
        min_rows, _ = row_policy(data, model.canary)
        verdict = "not run" if model.canary is None else "rows agree" if model.canary.rows_agree else \
            "rows differ (fallback: min_rows 2)"
        print(f"machine: {machine_line(model.backend['name'], args.threads)}")
        print(f"artifact: {art} ({data.get('precision')}); canary: {verdict}; a lone prompt decodes at "
              f"{min_rows} row(s)")
        prompts = [[int(t) for t in model.encode(model.chat_prompt([{"role": "user", "content":
                   f"Write one sentence about {TOPICS[i % len(TOPICS)]}."}]), add_special_tokens=False)["input_ids"][0]]
                   for i in range(args.prompts)]
        t = time.perf_counter()
        alone = [model.generate([r], max_new_tokens=args.tokens, stop_token_ids=[])[0, len(r):].tolist()
                 for r in prompts]
        times = {"alone": time.perf_counter() - t}
        groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
        got: dict[str, list[list[int]]] = {"Model.generate, a row each": [], "left-padded, one length": [],
                                           "scheduler (continuous batching)": []}
        t = time.perf_counter()
        for g in groups:
            out = model.generate(g, max_new_tokens=args.tokens, stop_token_ids=[])
            got["Model.generate, a row each"] += [row[-args.tokens:].tolist() for row in out]
        times["Model.generate, a row each"] = time.perf_counter() - t
        t = time.perf_counter()
        for g in groups:
            got["left-padded, one length"] += [row[-args.tokens:].tolist() for row in padded(model, g, args.tokens)]
        times["left-padded, one length"] = time.perf_counter() - t
        t = time.perf_counter()
        with Scheduler(model, slots=args.batch) as s:
            for g in groups:
                with s._lock:  # the loop waits for the lock: the batch's prompts are queued together
                    streams = [s.submit(r, max_new_tokens=args.tokens, stop_token_ids=[]) for r in g]
                got["scheduler (continuous batching)"] += [st.result() for st in streams]
        times["scheduler (continuous batching)"] = time.perf_counter() - t
        if min_rows > 1:  # the fallback's reason: the same prompts alone at one row
            t = time.perf_counter()
            got["alone at one row (M = 1)"] = [one_row(model, r, args.tokens) for r in prompts]
            times["alone at one row (M = 1)"] = time.perf_counter() - t
    n = len(prompts)
    print(f"\n{n} prompts, greedy, {args.tokens} tokens each; batches of {args.batch}; each against the prompt "
          f"alone ({n * args.tokens / times['alone']:.1f} tok/s alone)")
    print(f"{'path':<34} {'equal to alone':>15} {'first difference':>17} {'tok/s':>7}")
    for name, rows in got.items():
        diffs = [d for d in (divergence(r, a) for r, a in zip(rows, alone)) if d is not None]
        equal = n - len(diffs)
        first = f"step {min(diffs)}" if diffs else "-"
        print(f"{name:<34} {f'{equal} of {n}':>15} {first:>17} {n * args.tokens / times[name]:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
