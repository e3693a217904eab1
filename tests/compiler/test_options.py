"""kiln.compiler.options: every compile option is checked once, the same way for the Python API and the CLI."""

from __future__ import annotations

import argparse

import pytest

from kiln.cli import _parser
from kiln.compiler import options as O
from kiln.compiler.options import CompileOptions
from kiln.errors import UsageError


@pytest.mark.parametrize("field,value,message", [
    ("accuracy_level", 9, "--accuracy-level 9 is unknown"),
    ("precision", "int3", "precision 'int3' is not supported"),
    ("target", "tpu", "target 'tpu' is not supported"),
    ("task", "translation", "task 'translation' is unknown"),
    ("quant_method", "hqq", "--quant-method 'hqq' is unknown"),
    ("lm_head", "fp16", "--lm-head 'fp16' is unknown"),
    ("calibration_method", "mse", "--calibration-method 'mse' is unknown"),
    ("prune_method", "obs", "--prune-method 'obs' is unknown"),
    ("prune_layers", "global", "--prune-layers 'global' is unknown"),
    ("group_size", 48, "power of two"),
    ("group_size", 8, "power of two"),
    ("max_length", 1, "--max-length 1 is too small"),
    ("threads", 0, "--threads 0"),
    ("opset", 11, "--opset 11"),
    ("gptq_windows", 0, "--gptq-windows 0"),
    ("verify_max_length", 0, "--verify-max-length 0"),
    ("outlier_ratio", 0.5, "above 1"),
    ("smoothquant", 1.5, "alpha must be in [0, 1]"),
    ("latency_shape", (1,), "(batch, sequence)"),
    ("latency_budget_s", 0.0, "above 0"),
    ("prune", "layers=0.2", "components heads, ffn"),
    ("prune", "heads=1.0", "in [0, 1)"),
    ("max_drop", "mse=2", "--max-drop 'mse=2'"),
    ("max_drop", "cosine=1.5", "must be in (0, 1]"),
])
def test_python_api_checks_every_value_when_made(field, value, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        CompileOptions(**{field: value})


def test_replace_checks_again():
    from dataclasses import replace

    with pytest.raises(UsageError, match="--accuracy-level"):
        replace(CompileOptions(precision="int4"), accuracy_level=7)


@pytest.mark.parametrize("kwargs,message", [
    (dict(asym=True), "--asym configure INT4; add --precision int4"),
    (dict(static=True), "add --precision int8"),
    (dict(precision="fp16"), "add --target tensorrt"),
    (dict(prune_method="wanda"), "add --prune"),
    (dict(prune="auto"), "add --max-drop"),
    (dict(calibration="texts.txt"), "add --precision int8 or int4"),
    (dict(precision="int4", mixed_bits=True, quant_method="rtn"), "needs a solver"),
    (dict(precision="int4", asym=True, target="tensorrt"), "symmetric INT4 only"),
])
def test_combinations_are_checked_once_per_compile(kwargs, message):
    options = CompileOptions(**kwargs)  # each value on its own is fine
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        O.check(options)


def test_defaults_and_resolved_int4_pass_both_checks():
    O.check(CompileOptions())
    for kind in ("encoder", "decoder"):
        O.check(O.int4_defaults(kind, CompileOptions(precision="int4")))


def test_imported_checkpoint_options():
    got = O.for_imported(CompileOptions(), "ckpt", {"format": "gptq", "bits": 4, "group_size": -1})
    assert (got.precision, got.group_size, got.quant_method, got.asym, got.mixed_bits) == ("int4", 0, "rtn", False, False)
    with pytest.raises(UsageError, match="ckpt is already quantized"):
        O.for_imported(CompileOptions(precision="int8"), "ckpt", {"format": "gptq", "bits": 4})


def test_cli_choices_come_from_the_options_module():
    """argparse's choices are the options module's tuples, so the CLI cannot accept what the API refuses."""
    compile_parser = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["compile"]
    choices = {a.dest: tuple(a.choices) for a in compile_parser._actions if a.choices}
    assert choices == {"task": O.TASKS, "precision": O.PRECISIONS, "target": O.TARGETS,
                       "calibration_method": O.CALIBRATION_METHODS, "quant_method": O.QUANT_METHODS,
                       "prune_method": O.PRUNE_METHODS, "prune_layers": O.PRUNE_LAYERS, "lm_head": O.LM_HEADS,
                       "accuracy_level": O.ACCURACY_LEVELS, "kernels": O.KERNELS}
