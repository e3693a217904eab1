"""``kiln export-gptq``: kiln's GPTQ solver run on an FP checkpoint, its codes written as a GPTQ v1 checkpoint
(``gptq_format.write_v1``) that other loaders read."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.compiler.facts import model_facts
from kiln.compiler.load import load_checkpoint
from kiln.compiler.options import check, int4_defaults
from kiln.compiler.quantize import gptq
from kiln.compiler.quantize.driver import QuantDriver
from kiln.compiler.quantize.gptq_format import write_v1
from kiln.compiler.scoped import torch_threads
from kiln.compiler.staging import check_output, staging
from kiln.errors import UsageError


def export(checkpoint: str | Path, output: str | Path, options: Any, say: Any) -> Path:
    """``kiln export-gptq``: GPTQ (kiln's solver, ``options``' group size, act-order, symmetry, calibration) on
    the checkpoint, written as a GPTQ v1 checkpoint at ``output`` (staged, renamed at the end)."""
    options = replace(options, precision="int4", quant_method="gptq", mixed_bits=False)  # GPTQ v1: one width
    check(options)
    if options.target != "cpu":
        raise UsageError("export-gptq writes a checkpoint, not a target graph; drop --target")
    output = Path(output).absolute()
    check_output(output, options.force)
    say(f"load {checkpoint}")
    ckpt = load_checkpoint(checkpoint, options.task)
    if ckpt.codebook is not None:
        raise UsageError(f"{checkpoint} is already quantized ({ckpt.imported['format']}); export-gptq takes an FP checkpoint")
    if ckpt.tokenizer is None:
        raise UsageError(f"GPTQ calibrates on text read through the checkpoint's tokenizer; {ckpt.path} has none")
    gptq.check_group_size(ckpt.model, options.group_size, ckpt.path)
    options = int4_defaults(ckpt.kind, options)
    with staging(output, options.force) as root, torch_threads(options.threads):
        driver = QuantDriver(ckpt, model_facts(ckpt), options, say)
        driver.solve_gptq()
        # the solver ran on a copy; write the original model with the solved layers replaced by their codes
        qinfo = {"quant_method": "gptq", "bits": 4, "group_size": options.group_size or -1,
                 "desc_act": bool(options.act_order), "sym": not options.asym, "true_sequential": True,
                 "damp_percent": driver.gptq_info["damp"], "static_groups": bool(options.act_order), "checkpoint_format": "gptq",
                 "quantizer": ["kiln"]}
        write_v1(ckpt.model, driver.named, root, qinfo, ckpt.tokenizer)
        say(f"{len(driver.named)} layers written as GPTQ v1 ({driver.gptq_info['windows']} calibration windows, "
            f"{driver.gptq_info['seconds']:.0f}s)")
    say(f"wrote {output}")
    return output
