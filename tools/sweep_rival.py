"""transformers' own ONNX exporter on the architecture sweep's tiny checkpoints, beside kiln's results, in one run.

    python tools/sweep_rival.py --work DIR [--only TYPE ...] [--jobs 2] [--timeout 600]

``DIR`` is a work directory of ``tools/sweep_architectures.py`` (its ``results.jsonl`` and each type's ``ckpt``).
For every architecture the sweep built, a child process loads the checkpoint as the sweep did, exports it with
``transformers.exporters.OnnxExporter`` (``OnnxConfig(dynamic=True)``, its defaults otherwise, the pinned
transformers in this venv) from a 2 x 9 example, and runs the exported graph on ONNX Runtime at two shapes the
export never saw (1 x 5 and 3 x 17, every token attended; an encoder-decoder's decoder 4 tokens) against the eager
model: it passes when the first output (logits or hidden states) is within kiln's FP32 bound,
1e-4 x max(1, max |reference|). That is less than kiln's FP32 row asks (no KV cache, no padding, no generation
check), so the comparison flatters the rival where it differs.

Prints the side-by-side table (kiln's result from ``results.jsonl``) and the counts; results go to
``DIR/rival.jsonl`` (a rerun resumes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from sweep_architectures import VOCAB, auto_class, run_resumable, verdict  # noqa: E402

SHAPES = ((1, 5), (3, 17))
ABS_FACTOR = 1e-4  # kiln's FP32 bound (kiln/compiler/verify/parity.py TOLERANCES["fp32"])


def child(model_type: str, task: str, ckpt: Path) -> dict:
    """One architecture in this (child) process: export with transformers' exporter, run, compare."""
    import numpy as np
    import torch
    from transformers.exporters import OnnxConfig, OnnxExporter

    from kiln.compiler.capture import failure

    model = auto_class(task).from_pretrained(str(ckpt)).eval()
    seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))

    def inputs(batch: int, length: int, seed: int) -> dict:
        ids = torch.randint(3, VOCAB // 2, (batch, length), generator=torch.Generator().manual_seed(seed))
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if seq2seq:
            out["decoder_input_ids"] = ids[:, :4] if length >= 4 else ids
        return out

    def first(out: object) -> torch.Tensor:
        for key in ("logits", "last_hidden_state"):
            value = getattr(out, key, None) if not isinstance(out, dict) else out.get(key)
            if value is not None:
                return value
        return out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))

    start = time.perf_counter()
    try:
        exported = OnnxExporter().export(model, inputs(2, 9, 0), config=OnnxConfig(dynamic=True))
    except Exception as e:  # noqa: BLE001 - the exporter's failure is the finding
        return {"status": "fails", "stage": "export", "reason": f"{type(e).__name__}: {failure(e)}",
                "seconds": round(time.perf_counter() - start, 1)}
    worst = 0.0
    for i, (batch, length) in enumerate(SHAPES):
        feeds = inputs(batch, length, i + 1)
        with torch.no_grad():
            ref = first(model(**feeds)).float().numpy()
        try:
            got = np.asarray(first(exported(**feeds)), dtype=np.float32)
        except Exception as e:  # noqa: BLE001
            return {"status": "fails", "stage": f"run {batch}x{length}",
                    "reason": f"{type(e).__name__}: {failure(e)}", "seconds": round(time.perf_counter() - start, 1)}
        if got.shape != ref.shape:
            return {"status": "fails", "stage": f"run {batch}x{length}",
                    "reason": f"output shape {got.shape}, eager {ref.shape}",
                    "seconds": round(time.perf_counter() - start, 1)}
        err = float(np.abs(got - ref).max()) / (ABS_FACTOR * max(1.0, float(np.abs(ref).max())))
        worst = max(worst, err)
    status = "passes" if worst <= 1 else "fails"
    out = {"status": status, "over_bound": round(worst, 4), "seconds": round(time.perf_counter() - start, 1)}
    if status == "fails":
        out |= {"stage": "parity", "reason": f"first output {worst:.3g}x kiln's FP32 bound"}
    return out


def run_one(model_type: str, task: str, work: Path, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--child", model_type, "--task", task, "--work", str(work)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "status": "fails", "stage": "export", "reason": f"over {timeout} s"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = [x for x in p.stderr.splitlines() if x.strip()][-1:] or [f"exit {p.returncode}"]
        return {"model_type": model_type, "status": "fails", "stage": "process", "reason": tail[0][:200]}
    return {"model_type": model_type} | json.loads(lines[-1])


def table(kiln: dict[str, dict], rival: dict[str, dict]) -> str:
    rows = ["| model_type | kind | kiln | transformers.exporters ONNX | its reason |", "|---|---|---|---|---|"]
    both = kiln_only = rival_only = neither = 0
    for t in sorted(rival):
        k_ok = verdict(kiln[t])[0] in ("fused", "fallback")
        r_ok = rival[t]["status"] == "passes"
        both += k_ok and r_ok
        kiln_only += k_ok and not r_ok
        rival_only += r_ok and not k_ok
        neither += not (k_ok or r_ok)
        reason = "" if r_ok else f"{rival[t].get('stage', '')}: {rival[t].get('reason', '')}".replace("|", "/")
        rows.append(f"| {t} | {kiln[t].get('kind', '-')} | {verdict(kiln[t])[0]} | {rival[t]['status']} | "
                    f"{reason[:160]} |")
    n = len(rival)
    head = (f"{n} architectures: kiln {both + kiln_only} ({(both + kiln_only) / n:.1%}), transformers.exporters "
            f"{both + rival_only} ({(both + rival_only) / n:.1%}); both {both}, kiln only {kiln_only}, "
            f"exporter only {rival_only}, neither {neither}")
    return head + "\n\n" + "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--only", nargs="*")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--task", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(child(args.child, args.task, args.work / args.child / "ckpt")), flush=True)
        return
    kiln = {r["model_type"]: r for r in map(json.loads, (args.work / "results.jsonl").read_text().splitlines())}
    built = {t: r for t, r in kiln.items() if r.get("kind") and (args.work / t / "ckpt" / "config.json").exists()}
    if args.only:
        built = {t: r for t, r in built.items() if t in args.only}
    print(f"{len(built)} built architectures", file=sys.stderr)
    done = run_resumable(args.work / "rival.jsonl", list(built), args.jobs,
                         lambda t: run_one(t, built[t]["task"], args.work, args.timeout),
                         lambda r: f"{r['status']} {r.get('reason', '')[:120]}")
    print(table(kiln, {t: done[t] for t in built if t in done}))


if __name__ == "__main__":
    main()
