"""The Triton Python-backend model ``kiln export triton`` writes for decoders (copied as ``<name>/1/model.py``).

Decoupled (streaming) mode: each request is one prompt (``text_input``, with optional ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``), answered by one ``text_output`` response per text piece and a final
empty response flagged COMPLETE_FINAL. Every request of every ``execute`` call goes to one continuous-batching
scheduler over ``kiln.runtimes`` (``kiln.runtimes.scheduler``), so a Triton deployment batches decode steps across
requests as ``kiln serve`` does. A request that cannot run (too long, a bad setting, the queue full) is answered
with an error response at once; a cancelled request (``is_cancelled``) frees its slot at the next step.

Config ``parameters`` (strings): ``slots`` (requests decoded together, default 8), ``queue`` (requests that may wait
for a slot, default 64), ``threads`` (ONNX Runtime intra-op threads; default all cores). The artifact itself is in
``<name>/1/artifact``. Needs ``kiln`` (its runtime: numpy and onnxruntime) in the Python backend's environment.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

OPTIONS = {"max_tokens": ("max_new_tokens", int), "temperature": ("temperature", float), "top_p": ("top_p", float),
           "top_k": ("top_k", int), "seed": ("seed", int)}


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb  # provided by Triton's Python backend

        import kiln.runtimes as kr
        from kiln.runtimes.scheduler import Scheduler

        self.pb = pb
        config = json.loads(args["model_config"])
        if not pb.using_decoupled_model_transaction_policy(config):
            raise pb.TritonModelException(f"{config.get('name')}: kiln's generation model streams its tokens; set "
                                          "model_transaction_policy { decoupled: true } in config.pbtxt")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        root = Path(args["model_repository"]) / str(args["model_version"]) / "artifact"
        threads = int(params.get("threads") or 0) or None
        self.model = kr.load(root, backend="onnxruntime-cpu", threads=threads)
        self.scheduler = Scheduler(self.model, slots=int(params.get("slots") or 8),
                                   queue_limit=int(params.get("queue") or 64))
        self.pumps: list[threading.Thread] = []

    def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, options = self._request(request)
                pieces = self.scheduler.stream(prompt, **options)  # queued now: refusals are answered now
            except Exception as e:  # noqa: BLE001 - every refusal becomes this request's error response
                sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(str(e))),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            pump = threading.Thread(target=self._pump, args=(pieces, sender), daemon=True)
            pump.start()
            self.pumps = [p for p in self.pumps if p.is_alive()] + [pump]
        return None  # decoupled: responses go through each request's sender

    def _request(self, request: Any) -> tuple[str, dict[str, Any]]:
        pb = self.pb
        text = pb.get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise ValueError("text_input is missing: send the prompt as a string tensor of shape [1]")
        raw = text.as_numpy().reshape(-1)[0]
        prompt = raw.decode() if isinstance(raw, bytes) else str(raw)
        options: dict[str, Any] = {}
        for name, (key, kind) in OPTIONS.items():
            tensor = pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                options[key] = kind(tensor.as_numpy().reshape(-1)[0])
        temperature = options.get("temperature")
        if temperature is not None:  # OpenAI's convention, as kiln serve: 0 is greedy
            options["do_sample"] = temperature > 0
            options["temperature"] = temperature if temperature > 0 else 1.0
        return prompt, options

    def _pump(self, pieces: Any, sender: Any) -> None:
        pb = self.pb
        try:
            for piece in pieces:
                if sender.is_cancelled():
                    pieces.close()  # cancels the request: its slot is free at the next step
                    break
                out = pb.Tensor("text_output", np.array([piece.encode()], dtype=np.object_))
                sender.send(pb.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # noqa: BLE001 - a failed step ends this stream with its error
            sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(str(e))),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self.scheduler.close()
        for pump in self.pumps:
            pump.join(timeout=5)
        self.model.close()
