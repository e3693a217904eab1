"""Build the anchor graph for bench_encoder.py. Runs inside the anchor's own virtual environment
(.venv-anchor: optimum-onnx pins an older transformers than kiln uses).

    .venv-anchor/bin/python tools/anchor_encoder.py CHECKPOINT OUT_DIR [--int8]

Exports CHECKPOINT with optimum (feature-extraction), then applies ONNX Runtime's transformer
optimizer fusions (model_type bert, as optimum's ORTOptimizer O2 does) and writes
OUT_DIR/model_optimized.onnx; with --int8 also OUT_DIR/model_int8.onnx from ONNX Runtime's
quantize_dynamic (per-channel int8 weights, what users run today). Prints the fused-operator
statistics as JSON on stdout.
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
    if "--int8" in sys.argv:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # the fused graph fails ORT's shape inference inside the quantizer without DefaultTensorType
        quantize_dynamic(str(out / "model_optimized.onnx"), str(out / "model_int8.onnx"), per_channel=True,
                         weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    print(json.dumps(opt.get_fused_operator_statistics()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
