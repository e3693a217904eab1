"""kiln artifacts in lm-evaluation-harness: the model type ``kiln``, run on ``kiln.runtimes`` (numpy + ONNX Runtime,
no torch).

lm-evaluation-harness finds model types in its own registry and has no hook for a package to add one, so this
module is its command line with ``kiln`` registered::

    python -m kiln.evaluate.lm_eval run --model kiln --model_args artifact=out/ --tasks my_task \\
        --include_path my_tasks/

or, in Python, ``import kiln.evaluate.lm_eval`` before ``lm_eval.simple_evaluate(model="kiln", ...)``.
``model_args``: ``artifact`` (required), ``threads``, ``backend``, ``check`` (default true: the artifact's canary runs
at load and a mismatch refuses it; false measures it anyway, as ``kiln report`` does). A loglikelihood request is split into context
and continuation tokens exactly as ``kiln report --eval`` splits a multiple-choice example
(``kiln.evaluate.tasks.continuation``), so the two give the same numbers on the same data.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # this module is named after the package it adapts; its absence is the user's to fix
    raise ImportError("kiln.evaluate.lm_eval needs lm-evaluation-harness: pip install 'kiln[lm-eval]'") from e

import kiln.runtimes as kr
from kiln.errors import UsageError
from kiln.evaluate import tasks
from kiln.runtimes.sampling import log_softmax


@register_model("kiln")
class KilnLM(LM):
    """A kiln decoder artifact as an lm-evaluation-harness model (greedy generation, batch 1)."""

    def __init__(self, artifact: str | None = None, threads: int | None = None, backend: str = "onnxruntime",
                 check: bool | str = True, **unused: Any) -> None:
        super().__init__()
        if not artifact:
            raise UsageError("--model kiln needs --model_args artifact=DIR (a compiled kiln decoder)")
        # check=false measures an artifact its canary refuses (as kiln report does); lm-eval passes "False" as a bool
        checked = check if isinstance(check, bool) else str(check).lower() not in ("false", "0", "no")
        self.model = kr.load(artifact, backend=backend, threads=None if threads is None else int(threads), check=checked)
        if self.model.manifest.data["model"]["kind"] != "decoder":
            raise UsageError(f"{artifact} is a {self.model.manifest.data['model']['kind']} artifact; lm-evaluation-"
                             "harness' kiln model runs decoders")
        self.text = tasks.text_of(self.model)
        self.scorer = tasks.ArtifactScorer(self.model)
        self.name = str(artifact)
        stop = self.text.stop
        self.prefix = int(stop[0]) if stop else int(self.scorer.pad)  # what an empty context is conditioned on

    def _window(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """Context and continuation within the model's length, the context cut from the left (as lm-eval's own
        models do); an empty context is the end-of-text token."""
        ctx = ctx or [self.prefix]
        cont = cont[-(self.text.limit - 1):]
        return ctx[-(self.text.limit - len(cont)):], cont

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._window(*tasks.continuation(self.text.encode, context, continuation))
            out.append(tasks.loglikelihood(self.scorer, ctx, cont) if cont else (0.0, True))
            self.cache_hook.add_partial("loglikelihood", req.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """A text's whole log-likelihood, the first token conditioned on end-of-text, in windows of the model's
        length (each scores the tokens after the last window's, seeing up to a full window before them)."""
        out = []
        for req in requests:
            ids = [self.prefix, *self.text.encode(req.args[0])]
            total, done = 0.0, 1
            while done < len(ids):
                end = min(len(ids), done + self.text.limit - 1)
                start = max(0, end - self.text.limit)
                lp = log_softmax(self.scorer.logits(ids[start:end])[done - start - 1:end - start - 1])
                total += float(lp[np.arange(end - done), ids[done:end]].sum())
                done = end
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", 256))
            ids = self.text.encode(context)[-max(1, self.text.limit - new):]
            new = max(1, min(new, self.text.limit - len(ids)))
            tokens = []
            for t in self.scorer.generate(ids, new):
                if t in self.text.stop:
                    break
                tokens.append(t)
            text = self.text.decode(tokens)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.model.text_encoder.has_chat_template:
            raise UsageError(f"{self.name} has no chat template; run lm_eval without --apply_chat_template")
        return self.model.text_encoder.chat(chat_history, add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return self.name


def main() -> None:
    """lm-evaluation-harness' command line, with the ``kiln`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "python -m kiln.evaluate.lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
