"""Cross-encoders (`--runner pooling` on a reranker, or `--convert classify`): /rerank,
/v1/rerank, /v2/rerank, /score and /v1/score with vLLM's shapes; every kind of model
answers 404 for the routes of the other kinds."""

from __future__ import annotations

import httpx
import pytest

from tests.engine_sim.conftest import FAST, tokenize

RERANKER = ["BAAI/bge-reranker-v2-m3", "--runner", "pooling", "--max-model-len", "512", *FAST]
QUERY = "how do tokens get billed"
DOCS = [
    "The weather in Paris is mild.",
    "Tokens are billed per prompt and per completion.",
    "A cat sat on the mat.",
    "Every token billed: how prompts get counted.",
]


@pytest.fixture(scope="module")
def sim(module_sims):
    return module_sims(*RERANKER)


def pair_tokens(sim, query: str, doc: str) -> int:
    """A cross-encoder sees `[CLS] query [SEP] document [SEP]`: 3 special tokens more."""
    return tokenize(sim, prompt=query) + tokenize(sim, prompt=doc) + 3


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_relevance(sim, path):
    r = httpx.post(
        sim.url + path, json={"model": "BAAI/bge-reranker-v2-m3", "query": QUERY, "documents": DOCS}
    )
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "model", "usage", "results"} and body["id"].startswith("score-")
    assert body["model"] == "BAAI/bge-reranker-v2-m3"
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert {x["index"] for x in body["results"]} == {0, 1, 2, 3}
    assert all(
        x["document"] == {"text": DOCS[x["index"]], "multi_modal": None} for x in body["results"]
    )
    # The documents that share the query's words come first.
    assert {x["index"] for x in body["results"][:2]} == {1, 3}
    total = sum(pair_tokens(sim, QUERY, d) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}


def test_rerank_top_n_and_determinism(sim):
    url = sim.url + "/v1/rerank"
    full = httpx.post(url, json={"query": QUERY, "documents": DOCS}).json()
    top = httpx.post(url, json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert top["results"] == full["results"][:2]
    assert top["usage"] == full["usage"]  # every pair was scored


def test_score_pairs_one_to_many_and_many_to_many(sim):
    url = sim.url + "/score"
    one_to_many = httpx.post(url, json={"text_1": QUERY, "text_2": DOCS}).json()
    assert one_to_many["object"] == "list" and one_to_many["id"].startswith("score-")
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in one_to_many["data"])
    rerank = httpx.post(sim.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    by_index = {x["index"]: x["relevance_score"] for x in rerank["results"]}
    assert [d["score"] for d in one_to_many["data"]] == [by_index[i] for i in range(4)]
    u = one_to_many["usage"]
    assert (
        u["prompt_tokens"] == u["total_tokens"] == rerank["usage"]["total_tokens"]
        and u["completion_tokens"] == 0
    )
    many = httpx.post(
        sim.url + "/v1/score", json={"text_1": [QUERY, "cats"], "text_2": DOCS[:2]}
    ).json()
    assert len(many["data"]) == 2 and many["data"][0]["score"] == by_index[0]
    bad = httpx.post(url, json={"text_1": [QUERY, "cats"], "text_2": DOCS})
    assert bad.status_code == 400 and "1:1, 1:N or N:N" in bad.json()["error"]["message"]


def test_too_long_pair_is_400(sim):
    r = httpx.post(sim.url + "/v1/rerank", json={"query": QUERY, "documents": ["word " * 600]})
    err = r.json()["error"]
    assert r.status_code == 400 and "maximum context length is 512 tokens" in err["message"]


def test_a_reranker_serves_nothing_else(sim):
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": []}),
        ("/v1/embeddings", {"input": "hi"}),
    ]:
        r = httpx.post(sim.url + path, json=body)
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}, path


def test_other_models_do_not_rerank(module_sims):
    chat = module_sims("Qwen/Qwen3-8B", *FAST)
    embed = module_sims("BAAI/bge-small-en", "--runner", "pooling", *FAST)
    for s in (chat, embed):
        for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/score", "/v1/score"):
            r = httpx.post(
                s.url + path, json={"query": "q", "documents": ["d"], "text_1": "q", "text_2": "d"}
            )
            assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_convert_classify_makes_a_scorer(module_sims):
    qwen = module_sims("Qwen/Qwen3-Reranker-0.6B", "--convert", "classify", *FAST)
    r = httpx.post(qwen.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200 and len(r.json()["results"]) == 4
    embed = module_sims(
        "BAAI/bge-reranker-v2-m3", "--runner", "pooling", "--convert", "embed", *FAST
    )
    assert (
        httpx.post(embed.url + "/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code
        == 404
    )
    assert httpx.post(embed.url + "/v1/embeddings", json={"input": "q"}).status_code == 200
