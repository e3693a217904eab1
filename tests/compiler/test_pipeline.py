"""Recipes: one row per (target, kind, precision) of named stages; --disable-pass checked against the row."""

from __future__ import annotations

import json

import pytest

from conftest import fast_options
from kiln.cli import main
from kiln.compiler import compile
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import INT8, RECIPES, STAGES, ModelFacts, build_pass, recipe

FACTS = ModelFacts("decoder", 2, 4, 2, 16, 128)


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_builds_the_pass_it_is_named_for(name):
    assert build_pass(name, FACTS, CompileOptions(smoothquant=0.5)).name == name


@pytest.mark.parametrize("key", sorted(RECIPES))
def test_rows_name_known_stages_once_and_end_clean(key):
    row = RECIPES[key]
    assert set(row) <= set(STAGES) and len(row) == len(set(row))
    assert row[:4] == ("eliminate-identity", "fold-constants", "dedup-initializers", "eliminate-unused-io")
    assert row[-1] == ("check-tensorrt-ops" if key[0] == "tensorrt" else "eliminate-dead-nodes")


@pytest.mark.parametrize("target,kind", [("cpu", "decoder"), ("cpu", "encoder"), ("tensorrt", "decoder")])
def test_int8_rows_keep_the_fp32_fusions(target, kind):
    """An INT8 recipe is the FP32 one with the INT8 stages and a quantizer before the final cleanup: a pass
    added to the FP32 row and forgotten in an INT8 row shows here."""
    fp32 = [n for n in RECIPES[(target, kind, "fp32")] if n not in ("eliminate-dead-nodes", "check-tensorrt-ops")]
    for mode in ("int8", "int8-static"):
        row = RECIPES.get((target, kind, mode))
        if row is None:
            continue
        fp32_part = [n for n in row if n not in INT8 and not STAGES[n].quantizer
                     and n not in ("eliminate-dead-nodes", "check-tensorrt-ops", "kiln-kernels")]
        if (kind, mode) == ("encoder", "int8-static"):  # fuse-mha keeps Q/K/V plain MatMuls for the QDQ pairs
            fp32_part = [("fuse-attention" if n == "fuse-mha" else n) for n in fp32_part]
        # QDQ pairs wrap each expert's MatMuls; ONNX Runtime's MoE ops take no QDQ form
        expected = [n for n in fp32 if n != "fuse-moe"] if mode == "int8-static" else fp32
        assert fp32_part == expected, (mode, row)


def test_option_stages_only_when_asked():
    assert "smoothquant" not in recipe("decoder", CompileOptions(precision="int8"))
    assert "smoothquant" in recipe("decoder", CompileOptions(precision="int8", smoothquant=0.5))
    assert "split-outliers" not in recipe("decoder", CompileOptions(precision="int8", outlier_ratio=0))


def test_disabling_a_pass_of_an_int8_compile(checkpoints, tmp_path):
    """The INT8 driver used to hand the whole --disable-pass list to each sub-pipeline: 'no such pass'."""
    out = compile(checkpoints["bert"], tmp_path / "q", fast_options(precision="int8", disabled_passes=("fuse-bias-gelu",)))
    passes = {p["name"]: p for p in json.loads((out / "manifest.json").read_text())["passes"]}
    assert passes["fuse-bias-gelu"] == {"name": "fuse-bias-gelu", "disabled": True, "stats": {}}
    assert passes["quantize-int8"]["stats"]["quantized"] > 0 and "disabled" not in passes["split-outliers"]


def test_disabling_the_quantizer_is_a_usage_error(checkpoints, tmp_path, capsys):
    rc = main(["compile", str(checkpoints["bert"]), "-o", str(tmp_path / "q"), "-q", "--precision", "int8",
               "--disable-pass", "quantize-int8"])
    assert rc == 2 and "leaves a --precision int8 graph unquantized" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
