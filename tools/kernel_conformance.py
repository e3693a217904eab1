"""Kernel conformance table: every weight format kiln emits for the CPU target x M in {1, 2, 8}, ONNX Runtime's result
against a numpy reference of the same codes (kiln/compiler/quantize/conformance.py), at real layer shapes, on this
machine. Prints the machine line, then one row per format and shape: the worst error over its float-rounding bound at
each M (<= 1 agrees), whether each row of the M-row call equals the same row computed alone (M = 1), and whether the
calls of several rows agree with each other row for row (what decoding a lone row beside an idle one relies on).

    python tools/kernel_conformance.py [--shapes 576x1536 1536x576 576x49152] [--threads 2] [--markdown]

To see another ISA's kernels on this machine, run it under an emulated CPU, e.g. AVX2 only (Debian's qemu-user):
    qemu-x86_64 -cpu Haswell .venv/bin/python tools/kernel_conformance.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.compiler.quantize import conformance  # noqa: E402
from kiln.runtimes.canary import machine_line  # noqa: E402

SHAPES = ("576x1536", "1536x576", "576x49152", "2048x8192")
"""(K, N): SmolLM2-135M's attention/MLP in and out, its head (vocab 49152), a 1B model's MLP up projection."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="KxN layer shapes")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: its own)")
    p.add_argument("--markdown", action="store_true", help="print a markdown table (docs/verification.md)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    print(f"machine: {machine_line('onnxruntime-cpu', args.threads)}")
    rows = []
    start = time.perf_counter()
    for fmt in conformance.FORMATS:
        for k, n in shapes:
            if fmt.op == "GatherBlockQuantized" and n < 1000:
                continue  # a table is vocab x hidden: the head-like shapes only
            rows.append(conformance.check(fmt, k, n, threads=args.threads))
    ms = [str(m) for m in conformance.ROWS]
    if args.markdown:
        print("| format | K x N | " + " | ".join(f"M={m} err/bound" for m in ms)
              + " | rows = alone | rows of M > 1 agree | agrees |")
        print("|---|---|" + "---|" * len(ms) + "---|---|---|")
    else:
        print(f"{'format':<38} {'K x N':>11} " + " ".join(f"{'M=' + m:>9}" for m in ms)
              + "  rows=alone  M>1 agree  agrees")
    for r in rows:
        errs = [f"{r['error_over_bound'][m]:.3g}" for m in ms]
        same = "yes" if all(r["same_as_m1"].values()) else \
            "no (" + ", ".join(m for m in ms if not r["same_as_m1"][m]) + ")"
        several = "yes" if r.get("several_agree", True) else "no"
        if args.markdown:
            print(f"| {r['format']} | {r['k']} x {r['n']} | " + " | ".join(errs)
                  + f" | {same} | {several} | {'yes' if r['agrees'] else 'NO'} |")
        else:
            print(f"{r['format']:<38} {r['k']:>5}x{r['n']:<5} " + " ".join(f"{e:>9}" for e in errs)
                  + f"  {same:<10}  {several:<9}  {'yes' if r['agrees'] else 'NO'}")
    bad = [r for r in rows if not r["agrees"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} agree with the reference at every M "
          f"(bound: {conformance.RTOL:g} x the sum of |products|); {time.perf_counter() - start:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line("onnxruntime-cpu", args.threads), "rows": rows},
                                              indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
