"""Attention captured where transformers computes it: one node per attention call, carrying what the call carries,
and computing what the model's own attention computes."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler import capture

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


def tiny(kind: str):
    import transformers as T

    torch.manual_seed(0)
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **TINY))
    if kind == "gemma2":  # soft-capped scores, a sliding and a global layer
        return T.Gemma2ForCausalLM(T.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=5,
                                                  attn_logit_softcapping=20.0, **TINY))
    if kind == "gpt_oss":  # attention sinks
        return T.GptOssForCausalLM(T.GptOssConfig(num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=5, **TINY))
    if kind == "bert":
        return T.BertModel(T.BertConfig(**{k: v for k, v in TINY.items()}))
    raise ValueError(kind)


def run(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss", "bert"])
def test_the_captured_op_computes_what_the_model_computes(kind):
    """The model run eagerly with kiln's function in place of its own attention gives its own outputs (left-padded
    rows included): the node's semantics are the interface's, soft-cap, windows and sinks included."""
    model = tiny(kind).eval()
    for p in model.parameters():
        p.data += torch.randn_like(p) * 0.02
    ids = torch.randint(3, 120, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    want = run(model, ids, mask)
    with capture.capture() as log:
        got = run(model, ids, mask)
    assert log.captured == 2 and not log.delegated
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=2e-5), (got[real] - want[real]).abs().max()


def test_a_call_with_an_argument_the_node_cannot_carry_runs_the_models_own_function():
    calls = []

    def original(module, q, k, v, mask, scaling=None, dropout=0.0, **kw):
        calls.append(sorted(kw))
        return q.transpose(1, 2), None

    log = capture.Log()
    fn = capture._function("sdpa", original, log)
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    module.layer_idx = 4
    fn(module, q, q, q, None, indices=torch.zeros(3, dtype=torch.long), output_router_logits=False)
    assert calls == [["indices", "output_router_logits"]]
    assert log.captured == 0 and log.delegated == [
        {"module": "Module", "layer": 4, "why": "the call passes indices, which kiln's attention node does not carry"}]
    fn(module, q, q, q, None, output_router_logits=False)  # a flag passed down changes nothing: captured
    assert log.captured == 1


def test_the_interface_is_restored_even_when_tracing_fails():
    from transformers.modeling_utils import AttentionInterface

    before = dict(AttentionInterface._global_mapping)
    with pytest.raises(RuntimeError), capture.capture():
        assert AttentionInterface._global_mapping["sdpa"].__name__ == "kiln_attention_sdpa"
        raise RuntimeError("export failed")
    assert AttentionInterface._global_mapping == before


def test_an_export_failure_reads_as_its_root_cause():
    summary = ("Failed to export the model with torch.export. This is step 1/3 of exporting the model to ONNX.\n"
               "## Exception summary\n\n<class 'torch._dynamo.exc.UserError'>: Constraints violated (sequence)!\n"
               "(Refer to the full stack trace above for more information.)")
    assert capture.failure(RuntimeError(summary)) == "UserError: Constraints violated (sequence)!"
    assert capture.failure(ValueError("one line\nmore")) == "one line"
    assert capture.failure(KeyError()) == "KeyError"


def test_fixed_axes_pairs_nested_dynamic_shapes_with_the_graph_inputs_in_order():
    """The encoder-decoder's decoder declares its cache as a tuple of per-tensor specs: flattened in argument order,
    each pairs with its graph input, and only a declared axis the graph holds fixed is reported."""
    from types import SimpleNamespace as NS

    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    spec = {"ids": {0: batch, 1: seq}, "mask": None, "kv": ({0: batch}, {0: batch, 2: seq})}
    inputs = [NS(name="ids", shape=("b", "s")), NS(name="mask", shape=(2, 8)), NS(name="k", shape=("b", 2, 8)),
              NS(name="v", shape=("b", 2, 8))]
    assert capture.fixed_axes(inputs, spec) == [("v", 2, "sequence", 8)]
    inputs[0] = NS(name="ids", shape=("b", 8))
    assert capture.fixed_axes(inputs, spec) == [("ids", 1, "sequence", 8), ("v", 2, "sequence", 8)]
    assert capture.fixed_axes(inputs[:3], spec) == []  # an input dropped: no pairing is trusted
    spec["ids"] = {0: batch, 1: torch.export.Dim.STATIC}  # declared fixed (a decoder stepping one token): not reported
    assert capture.fixed_axes(inputs, spec) == [("v", 2, "sequence", 8)]


def test_a_cached_decoder_that_steps_one_token_is_traced_at_one():
    """ProphetNet's decoder asserts one new token per cached step: its graph is traced at that width."""
    from kiln.compiler.trace_seq2seq import step_width

    class Steps(torch.nn.Module):
        def __init__(self, most):
            super().__init__()
            self.most = most

        def forward(self, ids, mask, *kv):
            if ids.shape[1] > self.most:
                raise AssertionError(f"at most {self.most} new token(s) with a cache")
            return ids

    ids, mask = torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    assert step_width(Steps(8), ids, mask, []) is None
    assert step_width(Steps(1), ids, mask, []) == 1
    with pytest.raises(AssertionError, match="at most 0"):  # runs neither: the two-token error is the one raised
        step_width(Steps(0), ids, mask, [])
