"""kiln serve: OpenAI-compatible endpoints on tiny artifacts, dynamic batching that changes no result, streaming
equal to the plain response, chat through the shipped template, and every bad request a JSON 4xx."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import fast_options, make_model, make_tokenizer

import kiln.runtimes as kr
from kiln.cli import main

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from kiln.serve import create_app  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.fixture(scope="module")
def chat_decoder(tmp_path_factory):
    """The tiny Llama with a chat template in its tokenizer config, compiled."""
    from kiln.compiler import compile

    root = tmp_path_factory.mktemp("chat")
    make_model("llama", "causal-lm").save_pretrained(root / "ckpt", safe_serialization=True)
    tok = make_tokenizer("decoder")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root / "ckpt")
    return compile(root / "ckpt", root / "art", fast_options())


def client_of(app):
    """A test client that calls as a local one does: Host localhost (the server refuses other names)."""
    return TestClient(app, base_url="http://localhost")


def embed_alone(path, text):
    with kr.load(path, threads=1) as m:
        f = m.encode([text])
        out = m.run(f)
        v = out.get("sentence_embedding")
        if v is None:
            mask = f["attention_mask"][..., None]
            v = (out["last_hidden_state"] * mask).sum(1) / mask.sum(1)
        return v[0]


TEXTS = ["the cat sat on the mat", "compilers rewrite graphs", "a", "def f(x): return x * 2 + 1 # longer one"]


def test_embeddings_batched_concurrently_equal_each_text_alone(artifacts):
    app = create_app(artifacts["bert"], max_batch=32, max_wait_ms=50, threads=1)
    with client_of(app) as client:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda t: client.post("/v1/embeddings", json={"input": t}), TEXTS * 4))
        both = client.post("/v1/embeddings", json={"input": TEXTS[:2], "model": "x"}).json()
        metrics = client.get("/metrics").text
    for text, r in zip(TEXTS * 4, replies):
        assert r.status_code == 200
        got = np.asarray(r.json()["data"][0]["embedding"])
        np.testing.assert_allclose(got, embed_alone(artifacts["bert"], text), atol=1e-5)
    assert [d["index"] for d in both["data"]] == [0, 1] and both["usage"]["prompt_tokens"] > 0
    sizes = [line for line in metrics.splitlines() if line.startswith("kiln_batch_size_count")]
    single = next(line for line in metrics.splitlines() if line.startswith('kiln_batch_size_bucket{le="1"}'))
    runs, ones = int(sizes[0].split()[-1]), int(single.split()[-1])
    assert runs < 17 and ones < runs, f"{runs} model runs for 17 requests, {ones} of one text: nothing was batched"
    assert 'kiln_requests_total{endpoint="embeddings",status="200"} 17' in metrics


def test_completions_greedy_plain_and_streamed_agree_with_the_runtime(artifacts):
    path = artifacts["llama"]
    info: dict = {}  # the test model is trained anew each run: it may stop before 12 tokens; the server must agree
    with kr.load(path, threads=1) as m:
        want = "".join(m.stream("the cat sat", max_new_tokens=12, info=info))
    assert info["completion_tokens"] <= 12 and info["finish_reason"] == ("length" if info["completion_tokens"] == 12
                                                                           else "stop")
    with client_of(create_app(path, threads=1)) as client:
        plain = client.post("/v1/completions", json={"prompt": "the cat sat", "max_tokens": 12, "temperature": 0})
        streamed = client.post("/v1/completions", json={"prompt": "the cat sat", "max_tokens": 12, "temperature": 0,
                                                         "stream": True})
    body = plain.json()
    assert plain.status_code == 200 and body["choices"][0]["text"] == want and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == info["completion_tokens"]
    assert body["choices"][0]["finish_reason"] == info["finish_reason"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == info["finish_reason"]


def test_concurrent_streams_equal_each_request_served_alone(artifacts):
    prompts = [f"the {w} sat on the" for w in ("cat", "dog", "bird", "fox", "owl", "cow", "pig", "ant")]
    with client_of(create_app(artifacts["llama"], max_batch=8, threads=1)) as client:
        def ask(p):
            r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 20, "temperature": 0, "stream": True})
            return "".join(json.loads(x[6:])["choices"][0]["text"] for x in r.text.splitlines()
                           if x.startswith("data: {"))
        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, prompts))
    assert together == alone


def test_full_generation_queue_is_429_with_retry_after_and_metrics_show_the_batching(artifacts, monkeypatch):
    """One slot, a queue of one: with a request running and one waiting, the next is refused with 429 and a
    Retry-After (never an unbounded queue); /metrics shows decode batch sizes, TTFT, ITL and the queue depth."""
    import time

    from kiln.runtimes.onnxruntime import SlotCache
    from kiln.serve.app import Server

    decode = SlotCache.decode
    monkeypatch.setattr(SlotCache, "decode", lambda self, t, n: (time.sleep(0.05), decode(self, t, n))[1])
    server = Server(kr.load(artifacts["llama"], threads=1), max_batch=1, queue=1)
    with client_of(server.app()) as client:
        ok = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3, "temperature": 0,
                                                   "ignore_eos": True})
        held = [server.scheduler.submit([5, 9, 17], max_new_tokens=100, stop_token_ids=[]) for _ in range(2)]
        refused = client.post("/v1/completions", json={"prompt": "the dog", "max_tokens": 4})
        for h in held:
            h.cancel()
        assert [h.result() is not None and h.finish_reason for h in held] == ["cancelled", "cancelled"]
        metrics = client.get("/metrics").text
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3  # ignore_eos: exactly max_tokens
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full" and "retry later" in refused.json()["error"]["message"]
    assert 'kiln_decode_batch_size_bucket{le="1"}' in metrics and "kiln_generation_queue_depth 0" in metrics
    assert 'kiln_prefill_batch_size_bucket{le="1"}' in metrics
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if "_count" in line}
    assert counts["kiln_time_to_first_token_seconds_count"] >= 1  # the 3-token request; the held ones maybe
    assert counts["kiln_inter_token_latency_seconds_count"] >= 2


def test_chat_uses_the_shipped_template(chat_decoder):
    messages = [{"role": "user", "content": "hello there"}]
    with kr.load(chat_decoder, threads=1) as m:
        prompt = m.chat_prompt(messages)
        want = "".join(m.stream(prompt, max_new_tokens=8, chat=True))
    assert prompt == "<|user|> hello there\n<|assistant|> "
    with client_of(create_app(chat_decoder, threads=1)) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0})
        s = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                                       "stream": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == {"role": "assistant", "content": want}
    chunks = [json.loads(x[6:]) for x in s.text.splitlines() if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want


def test_kiln_generate_chat(chat_decoder, capsys):
    assert main(["generate", str(chat_decoder), "--prompt", "hello there", "--chat", "--max-new-tokens", "4"]) == 0
    assert main(["generate", str(chat_decoder), "--ids", "1,2", "--chat"]) == 2
    assert "drop --ids or --chat" in capsys.readouterr().err


@pytest.mark.parametrize("path,payload,status,words", [
    ("/v1/completions", b"{not json", 400, "not JSON"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt must be"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens 0 is invalid"),
    ("/v1/completions", {"prompt": "x", "temperature": 9}, 400, "temperature 9 is invalid"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n must be 1"),
    ("/v1/completions", {"prompt": "the cat " * 20, "max_tokens": 120}, 400, "KV-cache capacity"),
    ("/v1/completions", {"prompt": "the cat " * 20, "max_tokens": 120, "stream": True}, 400, "KV-cache capacity"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "no chat template"),
    ("/v1/embeddings", {"input": "x"}, 404, "it serves /v1/completions"),
])
def test_bad_requests_are_json_4xx(artifacts, path, payload, status, words):
    with client_of(create_app(artifacts["llama"], threads=1)) as client:
        r = (client.post(path, content=payload, headers={"content-type": "application/json"}) if isinstance(payload, bytes)
             else client.post(path, json=payload))
        assert r.status_code == status, r.text
        assert words in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
        assert client.get("/health").json()["status"] == "ok"
        assert f'status="{status}"' in client.get("/metrics").text


def test_encoder_bad_requests(artifacts):
    with client_of(create_app(artifacts["bert"], threads=1)) as client:
        too_long = client.post("/v1/embeddings", json={"input": "word " * 500})
        empty = client.post("/v1/embeddings", json={"input": []})
        gen = client.post("/v1/completions", json={"prompt": "x"})
    assert too_long.status_code == 400 and "longer than the model's maximum" in too_long.json()["error"]["message"]
    assert empty.status_code == 400 and gen.status_code == 404


def test_serve_flags_are_checked(artifacts, capsys, tmp_path):
    from conftest import save_checkpoint

    from kiln.compiler import compile

    assert main(["serve", str(artifacts["bert"]), "--port", "0"]) == 2
    assert main(["serve", str(artifacts["bert"]), "--max-batch", "0"]) == 2
    assert "give at least 1" in capsys.readouterr().err
    bare = compile(save_checkpoint(tmp_path / "ck", "llama", "causal-lm", tokenizer=False), tmp_path / "a",
                   fast_options())
    assert main(["serve", str(bare)]) == 2 and "ships no tokenizer" in capsys.readouterr().err


def test_length_groups_bound_padding_and_rows():
    from kiln.serve.batching import PAD_SLACK, length_groups

    lengths = sorted([3, 3, 4, 4, 5, 9, 10, 10, 30, 31, 60] + [7] * 40)
    groups = length_groups(lengths, 16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real = sum(lengths[i] for i in g)
        assert len(g) <= 16 and len(g) * max(lengths[i] for i in g) <= PAD_SLACK * real
    assert len(groups) < len(lengths) / 3  # still batches
