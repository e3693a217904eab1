"""No pass names a model family: passes work from a graph's structure and the captured attention node, never from
what a model is called (issue 41). Checked against every model type transformers registers; the few model types that
are also ordinary words (a clip threshold, a 4-bit code) are left out of the check."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

ORDINARY_WORDS = {"clip", "bit", "encoder-decoder", "beam", "ergo", "flint", "dory", "laguna", "mega", "git",
                  "funnel", "perceiver", "reformer", "canine", "esm", "opt"}


def family_names_in(paths: list[Path]) -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    names = {re.sub(r"[-_]", "[-_ ]?", n) for n in CONFIG_MAPPING_NAMES if len(n) >= 3 and n not in ORDINARY_WORDS}
    pattern = re.compile(r"\b(" + "|".join(sorted(names | {"gpt-2", "llama.cpp"}, key=len, reverse=True)) + r")\b",
                         re.I)
    return [f"{p.name}:{i}: {m.group(0)}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) for m in pattern.finditer(line)]


def test_no_pass_names_a_model_family():
    assert family_names_in(sorted((ROOT / "kiln" / "passes").glob("*.py"))) == []


def test_the_check_sees_a_planted_family_name(tmp_path):
    planted = tmp_path / "fuse_x.py"
    planted.write_text('"""Fuses what Qwen3 and GPT-2 trace."""\nclip = 1  # an ordinary word\n')
    assert family_names_in([planted]) == ["fuse_x.py:1: Qwen3", "fuse_x.py:1: GPT-2"]
