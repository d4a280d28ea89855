"""``pagedllm serve --runner pooling`` through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_bert_embeddings import reference_embeddings

from helpers.sentences import SENTENCES

# Starts a server on the real all-MiniLM-L6-v2. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(minilm_path) -> torch.Tensor:
    return reference_embeddings(minilm_path, SENTENCES)


def _assert_error(resp: httpx.Response, status: int, param: str | None = None, match: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    assert match.lower() in err["message"].lower(), err
    return err


def test_openai_client_batched_and_alone(embedding_server, reference):
    client = embedding_server.client()
    resp = client.embeddings.create(model="minilm", input=SENTENCES)
    assert [d.index for d in resp.data] == list(range(32))
    for d, ref in zip(resp.data, reference):
        assert F.cosine_similarity(torch.tensor(d.embedding), ref, dim=0).item() > 0.9999
    tok_counts = 0
    for i in (0, 9, 29):
        alone = client.embeddings.create(model="minilm", input=SENTENCES[i], encoding_format="float")
        assert F.cosine_similarity(torch.tensor(alone.data[0].embedding), reference[i], dim=0).item() > 0.9999
        tok_counts += alone.usage.prompt_tokens
        assert alone.usage.total_tokens == alone.usage.prompt_tokens > 2
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > tok_counts


def test_base64_round_trips(embedding_server, reference):
    # The openai client asks for base64 by default and decodes it itself (numpy, little-endian float32).
    resp = embedding_server.client().embeddings.create(model="minilm", input=SENTENCES[:3])
    for d, ref in zip(resp.data, reference):
        assert F.cosine_similarity(torch.tensor(d.embedding), ref, dim=0).item() > 0.9999
    raw = httpx.post(f"{embedding_server.url}/v1/embeddings",
                     json={"input": SENTENCES[1], "encoding_format": "base64"}).json()
    flt = httpx.post(f"{embedding_server.url}/v1/embeddings", json={"input": SENTENCES[1]}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(flt["data"][0]["embedding"], abs=0)
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and raw["model"] == "minilm"


def test_token_id_inputs(embedding_server, reference):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedding_server_path(embedding_server))
    ids = [tok.encode(s) for s in SENTENCES[:2]]
    client = embedding_server.client()
    one = client.embeddings.create(model="minilm", input=ids[0], encoding_format="float")
    many = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert one.usage.prompt_tokens == len(ids[0])
    assert F.cosine_similarity(torch.tensor(one.data[0].embedding), reference[0], dim=0).item() > 0.9999
    for d, ref in zip(many.data, reference[:2]):
        assert F.cosine_similarity(torch.tensor(d.embedding), ref, dim=0).item() > 0.9999


def embedding_server_path(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["root"]


def test_bad_inputs_get_openai_shaped_400s(embedding_server):
    url = f"{embedding_server.url}/v1/embeddings"
    _assert_error(httpx.post(url, json={"input": []}), 400, "input", "empty")
    _assert_error(httpx.post(url, json={"input": ""}), 400, "input", "empty")
    _assert_error(httpx.post(url, json={"input": [[]]}), 400, "input", "empty")
    _assert_error(httpx.post(url, json={"input": [1, 2, 10**9]}), 400, "input", "out of range")
    _assert_error(httpx.post(url, json={"input": "word " * 300}), 400, "input", "maximum context length")
    _assert_error(httpx.post(url, json={"input": "hi", "dimensions": 8}), 400, "dimensions", "matryoshka")
    _assert_error(httpx.post(url, json={"input": "hi", "encoding_format": "int8"}), 400, "encoding_format")
    _assert_error(httpx.post(url, json={"input": "hi", "model": "nope"}), 404, "model", "does not exist")
    _assert_error(httpx.post(url, json={"input": {"a": 1}}), 400, "input")
    _assert_error(httpx.post(url, json={"input": "hi", "truncate_prompt_tokens": 100000}), 400,
                  "truncate_prompt_tokens")
    # The server still works after all of that.
    assert httpx.post(url, json={"input": "hi"}).status_code == 200


def test_truncation(embedding_server):
    resp = httpx.post(f"{embedding_server.url}/v1/embeddings",
                      json={"input": ["word " * 300, "short"], "truncate_prompt_tokens": -1}).json()
    assert resp["usage"]["prompt_tokens"] == 256 + 3
    assert len(resp["data"]) == 2


def test_generation_endpoints_answer_400(embedding_server):
    client = embedding_server.client()
    import openai

    with pytest.raises(openai.BadRequestError, match="does not support text generation"):
        client.completions.create(model="minilm", prompt="Hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="does not support text generation"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])


def test_pooling_and_score(embedding_server, reference):
    url = embedding_server.url
    pooled = httpx.post(f"{url}/pooling", json={"input": SENTENCES[:2]}).json()
    assert pooled["data"][0]["object"] == "pooling"
    assert F.cosine_similarity(torch.tensor(pooled["data"][1]["data"]), reference[1], dim=0).item() > 0.9999
    score = httpx.post(f"{url}/score", json={"text_1": SENTENCES[3], "text_2": [SENTENCES[4], SENTENCES[7]]}).json()
    expected = [float(reference[3] @ reference[4]), float(reference[3] @ reference[7])]
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-4)
    assert score["data"][0]["score"] > score["data"][1]["score"]  # Paris/France beats Fibonacci code
    _assert_error(httpx.post(f"{url}/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400, "text_1")
