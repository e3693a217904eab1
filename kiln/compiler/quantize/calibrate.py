"""Calibration text through an intermediate graph: the compared output per batch (pooled rows or logits)
for the accuracy budget, and activation statistics for the calibrated passes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from kiln.compiler import graphrun
from kiln.compiler.load import Checkpoint
from kiln.compiler.pipeline import ModelFacts
from kiln.compiler.trace import io_specs
from kiln.compiler.verify import cases
from kiln.errors import UsageError
from kiln.passes.calibration import Statistics

BATCH = 16
MAX_TOKENS = 128

Feeds = dict[str, np.ndarray]


def text_batches(ckpt: Checkpoint, texts: Sequence[str], source: str) -> list[Feeds]:
    """Tokenised texts, padded on the model's side in batches. A text needs at least two tokens that are
    neither special nor unknown (one token predicting the next); others are dropped."""
    tok = ckpt.tokenizer
    inputs = [s.name for s in io_specs(ckpt)[0]]
    limit = min(ckpt.max_length, MAX_TOKENS)
    ignore = set(tok.all_special_ids) | ({tok.unk_token_id} if tok.unk_token_id is not None else set())
    rows = [r for r in (tok(t, add_special_tokens=True, truncation=True, max_length=limit)["input_ids"] for t in texts)
            if sum(i not in ignore for i in r) >= 2]
    if not rows:
        raise UsageError(f"calibration text {source} has no usable tokens for {ckpt.path}'s tokenizer ({len(texts)} "
                         "texts, none with two known tokens); give real sentences in the model's language")
    return [cases.make_feeds(*cases.pad(rows[i:i + BATCH], ckpt.pad_token_id, ckpt.padding_side), inputs)
            for i in range(0, len(rows), BATCH)]


class GraphRunner:
    """Runs an intermediate graph (from a file, see ``graphrun``) on calibration feeds."""

    def __init__(self, facts: ModelFacts, threads: int | None) -> None:
        self.facts = facts
        self.threads = threads

    def _feeds(self, sess: Any, f: Feeds) -> Feeds:
        out = {}
        for i in sess.get_inputs():
            if i.name in f:
                out[i.name] = f[i.name]
            elif i.name.startswith("past_key_values."):  # an empty KV cache: the whole text is the prompt
                out[i.name] = np.zeros((len(f["input_ids"]), self.facts.num_kv_heads, 0, self.facts.head_size), np.float32)
        return out

    def __call__(self, model: onnx.ModelProto, feeds: list[Feeds]) -> list[np.ndarray]:
        """The compared output per feed: logits (decoders), the sentence embedding, or the mean-pooled first output."""
        sess = graphrun.session(model, self.threads)
        names = [o.name for o in sess.get_outputs()]
        rows = []
        for f in feeds:
            out = dict(zip(names, sess.run(None, self._feeds(sess, f))))
            if self.facts.kind == "decoder":
                rows.append(out["logits"])
            elif "sentence_embedding" in out:
                rows.append(out["sentence_embedding"])
            else:
                first = out[names[0]]
                m = f["attention_mask"][..., None]
                rows.append((first * m).sum(1) / m.sum(1) if first.ndim == 3 else first)
        return rows

    def statistics(self, model: onnx.ModelProto, names: Sequence[str], feeds: list[Feeds]) -> Statistics:
        sess = graphrun.session(graphrun.expose(model, names), self.threads)
        outs = [o.name for o in sess.get_outputs()]
        stats = Statistics()
        for f in feeds:
            got = dict(zip(outs, sess.run(None, self._feeds(sess, f))))
            # padding positions are not the model's data: only real tokens shape the ranges
            keep = f["attention_mask"].astype(bool)
            stats.observe({n: got[n][keep] if got[n].shape[:2] == keep.shape else got[n] for n in names})
        return stats
