"""The decoder anchor for bench_decoder.py, run inside its own virtual environment (.venv-anchor:
optimum-onnx pins an older transformers than kiln uses).

    .venv-anchor/bin/python tools/anchor_decoder.py CHECKPOINT OUT_DIR THREADS [int4]

Exports CHECKPOINT with optimum (text-generation-with-past: one graph with past_key_values inputs),
with ``int4`` quantizes its MatMuls with ONNX Runtime's MatMulNBitsQuantizer (round-to-nearest, symmetric,
block 32, accuracy level 4: the usual optimum + ORT INT4 recipe), loads it as ORTModelForCausalLM, prints "ready", then answers one JSON request per stdin line
({"ids": [[...]], "mask": [[...]], "max_new_tokens": N}) with {"seconds": s, "tokens": [[...]]}:
a greedy ``generate`` timed in this process, so the driver can alternate systems round by round.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> int:
    ckpt, out, threads = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    import onnxruntime as ort
    import torch
    from optimum.exporters.onnx import main_export
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(threads)
    main_export(str(ckpt), output=str(out), task="text-generation-with-past", device="cpu", do_validation=False)
    if len(sys.argv) > 4 and sys.argv[4] == "int4":
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        graph = next(out.glob("*.onnx"))
        q = MatMulNBitsQuantizer(onnx.load(str(graph)), block_size=32, is_symmetric=True, accuracy_level=4)
        q.process()
        for f in out.glob("*.onnx*"):
            f.unlink()
        q.model.save_model_to_file(str(graph), use_external_data_format=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as kiln's side of the bench
    model = ORTModelForCausalLM.from_pretrained(str(out), session_options=opts, provider="CPUExecutionProvider")
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ids, mask = torch.tensor(req["ids"]), torch.tensor(req["mask"])
        n = req["max_new_tokens"]
        start = time.perf_counter()
        seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": seqs[:, ids.shape[1]:].tolist()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
