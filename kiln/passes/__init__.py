"""Graph passes: ONNX model in, ONNX model out, each reporting what it changed and what it skipped.

Passes never import the compiler or a runtime; calibration data and options are handed to them.
The package's own names are imported on first use, so ``kiln.passes.codes`` (numpy only: the quantization math the
options' defaults come from) loads without ONNX: the CLI's parser and the runtime stay free of it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NoMatch", "Pass", "PassError", "PassResult", "Reason", "check_disabled", "run_passes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kiln.passes import base

        return getattr(base, name)
    raise AttributeError(f"module 'kiln.passes' has no attribute {name!r}")
