"""The pass pipeline as data: which passes run for a model kind and precision, in order.

The foundation exports an already-folded graph (the exporter's own optimizer runs) and selects
no further passes yet; fusion, KV-cache and quantization passes are added to these lists.
"""

from __future__ import annotations

from kiln.passes import Pass

PIPELINES: dict[tuple[str, str], list[type[Pass]]] = {
    ("encoder", "fp32"): [],
    ("decoder", "fp32"): [],
}


def select_passes(kind: str, precision: str) -> list[Pass]:
    return [cls() for cls in PIPELINES[(kind, precision)]]
