"""Checkpoint -> verified artifact. Needs the ``compile`` extra (torch, transformers, onnx).

    from kiln.compiler import compile, CompileOptions
    compile("ckpt/", "out/", CompileOptions(threads=2))

Attributes are imported lazily so ``kiln --help`` and ``kiln run`` start without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compile", "CompileOptions"]


def __getattr__(name: str) -> Any:
    if name == "compile":
        from kiln.compiler.build import compile

        return compile
    if name == "CompileOptions":
        from kiln.compiler.options import CompileOptions

        return CompileOptions
    raise AttributeError(name)
