"""Build the anchor graph for bench_encoder.py. Runs inside the anchor's own virtual environment
(.venv-anchor: optimum-onnx pins an older transformers than kiln uses).

    .venv-anchor/bin/python tools/anchor_encoder.py CHECKPOINT OUT_DIR

Exports CHECKPOINT with optimum (feature-extraction), then applies ONNX Runtime's transformer
optimizer fusions (model_type bert, as optimum's ORTOptimizer O2 does) and writes
OUT_DIR/model_optimized.onnx. Prints the fused-operator statistics as JSON on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    from optimum.exporters.onnx import main_export
    from onnxruntime.transformers.optimizer import optimize_model
    from transformers import AutoConfig

    main_export(str(ckpt), output=str(out), task="feature-extraction", device="cpu", do_validation=True)
    cfg = AutoConfig.from_pretrained(str(ckpt))
    opt = optimize_model(str(out / "model.onnx"), model_type="bert", num_heads=cfg.num_attention_heads,
                         hidden_size=cfg.hidden_size, opt_level=2, use_gpu=False)
    opt.save_model_to_file(str(out / "model_optimized.onnx"))
    print(json.dumps(opt.get_fused_operator_statistics()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
