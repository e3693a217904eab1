"""``build`` for encoder-decoder checkpoints: two graphs, cleanup passes on each, verification by
greedy generation against Hugging Face ``generate`` (see ``kiln.compiler.seq2seq``)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kiln.runtimes as kr
from kiln.compiler import cases as case_lib
from kiln.compiler import seq2seq
from kiln.compiler.artifact import write_manifest
from kiln.compiler.load import Checkpoint
from kiln.compiler.options import CompileOptions
from kiln.compiler.verify import failures
from kiln.errors import ParityError, UnsupportedModelError, UsageError
from kiln.passes import check_disabled, run_passes
from kiln.passes.cleanup import EliminateDeadNodes
from kiln.passes.decompose_norm import DecomposeNorm
from kiln.passes.fuse_mha import FuseMultiHeadAttention
from kiln.runtimes.artifact import REPORT, SCHEMA_VERSION

STEPS = 16


def build_seq2seq(ckpt: Checkpoint, root: Path, options: CompileOptions, say: Callable[[str], None],
                  manifest_base: Callable[..., dict[str, Any]], copy_tokenizer: Callable[..., Any],
                  generation_defaults: Callable[[Checkpoint], dict[str, Any]]) -> None:
    import onnx

    from kiln.compiler.pipeline import CLEANUP, FusionCoverageError, ModelFacts

    if options.precision != "fp32":
        raise UsageError(f"{ckpt.architecture} compiles at --precision fp32 only; INT8 encoder-decoders are not "
                         "supported yet")
    if options.target != "cpu":
        raise UnsupportedModelError(f"{ckpt.architecture} compiles for --target cpu only; encoder-decoder TensorRT "
                                    "graphs are not supported yet")
    say(f"export {ckpt.architecture} ({ckpt.task}) to an encoder and a decoder graph, ONNX opset {options.opset}")
    seq2seq.export(ckpt, root, options.opset)
    s = seq2seq.shapes(ckpt)
    facts = ModelFacts("seq2seq", s["layers"], s["heads"], s["heads"], s["head_size"], ckpt.max_length)
    record: list[dict[str, Any]] = []
    # one MultiHeadAttention per encoder layer; self + cross per decoder layer
    expected = {seq2seq.ENCODER: s["encoder_layers"], seq2seq.DECODER: 2 * s["layers"]}
    problems = []
    for graph in (seq2seq.ENCODER, seq2seq.DECODER):
        passes = [make(facts) for make in CLEANUP] + [FuseMultiHeadAttention(s["heads"], s["head_size"]),
                                                       DecomposeNorm(), EliminateDeadNodes()]
        check_disabled(passes, options.disabled_passes)
        model, rec = run_passes(onnx.load(str(root / graph)), passes, options.disabled_passes, say)
        onnx.save_model(model, str(root / graph))
        for r in rec:
            r["graph"] = graph.split(".")[0]
            if r["name"] == "fuse-mha" and not r.get("disabled"):
                r["coverage"] = {"expected": expected[graph], "fused": r["stats"]["fused"]}
                if r["stats"]["fused"] < expected[graph]:
                    why = "; ".join(f"{x['where']}: {x['why']}" for x in r.get("skipped", [])[:3]) or "no candidates found"
                    problems.append(f"fuse-mha fused {r['stats']['fused']} of {expected[graph]} expected in {graph} ({why})")
        record += rec
    if problems and not options.allow_partial_fusion:
        raise FusionCoverageError(f"incomplete fusion: {' | '.join(problems)}; pass --allow-partial-fusion to ship it "
                                  "anyway, or --disable-pass the rule")
    for problem in problems:
        say(f"warning: {problem} (--allow-partial-fusion)")
    tok = case_lib.load_hf_tokenizer(ckpt.path)
    manifest = manifest_base(ckpt, facts, options, record, copy_tokenizer(ckpt, tok, root))
    spec = seq2seq.io(ckpt)
    names = seq2seq.names(s["layers"])
    manifest["graphs"] = {"encoder": seq2seq.ENCODER, "decoder": seq2seq.DECODER}
    manifest["inputs"] = [t.to_json() for t in spec["encoder"]["inputs"]]
    manifest["outputs"] = [t.to_json() for t in spec["encoder"]["outputs"]]
    manifest["decoder"] = {"inputs": [t.to_json() for t in spec["decoder"]["inputs"]],
                           "outputs": [t.to_json() for t in spec["decoder"]["outputs"]]}
    manifest["kv_cache"] = {"layout": ["batch", "heads", "sequence", "head_size"], "dtype": "float32",
                            "num_layers": s["layers"], "num_kv_heads": s["heads"], "head_size": s["head_size"],
                            "past": names["past"], "present": names["present"], "cross": names["cross"],
                            "capacity": options.max_length or ckpt.max_length, "shared_buffer": False}
    manifest["generation"] = dict(generation_defaults(ckpt), decoder_start_token_id=int(ckpt.config.decoder_start_token_id))
    write_manifest(root, manifest)
    if not options.verify:
        say("verification skipped (--no-verify)")
        return
    say(f"verify generation: {STEPS} greedy steps through encoder + cached decoder vs Hugging Face generate")
    ids, mask = seq2seq.prompts(ckpt, tok, options.seed)
    with kr.load(root, threads=options.threads) as artifact:
        gen = seq2seq.verify(ckpt, artifact, ids, mask, STEPS, options.precision)
    report = {"schema_version": SCHEMA_VERSION, "checkpoint": str(ckpt.path), "precision": options.precision,
              "generation": gen, "passed": gen["passed"], "cases": [], "summary": {}}
    if not gen["passed"]:
        kept = Path(tempfile.mkdtemp(prefix="kiln-parity-")) / REPORT
        kept.write_text(json.dumps(report, indent=2))
        raise ParityError(f"parity check failed for {ckpt.path}: {'; '.join(failures(report))}; no artifact written, "
                          f"full report in {kept}")
    (root / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    manifest["verification"] = {"status": "passed", "report": REPORT, "summary": {},
                                "generation": {k: gen[k] for k in ("steps", "batch", "tokens_identical",
                                                                   "max_abs_over_atol", "ties")}}
    write_manifest(root, manifest)
