"""The generation check's reference is the model's own greedy answer for every row: the checkpoint's generation config
(its logits processors) does not pick the tokens, and a model whose forward cannot place a left-padded row is
referenced row by row. Also: a config that says it has no length limit is not a limit of -1."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kiln.compiler.load import Family, max_length
from kiln.compiler.verify.generation import greedy_config, places_padded_rows

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=64)


def llama():
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**TINY)).eval()


def test_the_reference_is_the_models_argmax_whatever_its_generation_config_asks():
    """A checkpoint that suppresses the model's own first choice and stops at it (as Whisper's suppressed tokens,
    or an end-of-sequence id that a minimum length suppresses): inside ``greedy_config`` the reference picks the
    argmax of the logits it reports at every step, and the checkpoint's config is back afterwards."""
    model = llama()
    ids = torch.tensor([[5, 9, 17, 3]])
    with torch.no_grad():
        first = int(model(input_ids=ids).logits[0, -1].argmax())
    own = model.generation_config
    own.suppress_tokens, own.eos_token_id, own.repetition_penalty = [first], first, 3.0
    with torch.no_grad():  # the planted config does change what plain generate picks
        planted = model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    assert int(planted[0, -1]) != first
    with torch.no_grad(), greedy_config(model, 6, 0) as config:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, ids.shape[1]:].numpy()
    assert len(tokens) == 6 and tokens[0] == first  # no stop at the end-of-sequence id either
    assert all(int(np.argmax(out.logits[t][0].numpy())) == tokens[t] for t in range(6))
    assert model.generation_config is own and own.suppress_tokens == [first]


def test_a_forward_without_position_ids_cannot_place_a_padded_row():
    import transformers as T

    whisper = T.WhisperForCausalLM(T.WhisperConfig(vocab_size=128, d_model=32, decoder_layers=1,
                                                   decoder_attention_heads=2, decoder_ffn_dim=64,
                                                   max_target_positions=64, pad_token_id=0, bos_token_id=1,
                                                   eos_token_id=2, decoder_start_token_id=1))
    assert places_padded_rows(llama()) is True
    assert places_padded_rows(whisper) is False


def test_a_config_without_a_length_limit_takes_the_default():
    no_limit = SimpleNamespace(max_position_embeddings=-1)  # XLNet: relative positions only
    assert max_length(no_limit, Family("decoder")) == 512
    assert max_length(SimpleNamespace(max_position_embeddings=-1, n_positions=256), Family("decoder")) == 256
    assert max_length(SimpleNamespace(max_position_embeddings=130), Family("encoder", position_offset=2)) == 128


def test_a_generation_failure_against_rows_alone_says_why():
    from kiln.compiler.verify.parity import failures

    gen = {"passed": False, "wrong_tokens": [], "max_abs_over_atol": 8.7e3, "cosine_min": 0.2, "tokens_identical": True}
    assert "position_ids" not in failures({"generation": gen | {"reference": "batch"}, "cases": []})[0]
    said = failures({"generation": gen | {"reference": "rows alone", "through": "kv cache"}, "cases": []})[0]
    assert "takes no position_ids" in said and "not supported yet" in said
    # without a cache kiln recomputes each row from position 0: padding is not the reason there
    recomputed = gen | {"reference": "rows alone", "through": "recompute (no KV cache)"}
    assert "position_ids" not in failures({"generation": recomputed, "cases": []})[0]
