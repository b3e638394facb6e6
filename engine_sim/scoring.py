"""/score, /v1/score, /rerank, /v1/rerank and /v2/rerank on a cross-encoder (vLLM's
ServingScores; served only by scoring models, every other model answers 404).

Each (query, document) pair is one prefill of `[CLS] query [SEP] document [SEP]`; usage
counts the tokens of every pair. Scores are deterministic, in (0, 1), and higher the more of
the query's words the document contains, so a rerank puts the relevant documents first.
"""

from __future__ import annotations

import math
import re
import time
import uuid
import zlib

from engine_sim import tokenizer
from engine_sim.cli import Config
from engine_sim.engine import Engine, Sequence
from engine_sim.errors import ApiError, bad_request, context_error
from engine_sim.generation import Generator, priority_of
from engine_sim.http import Connection, Request

# The field pairs vLLM's ScoreRequest accepts, in the order it tries them.
SCORE_FIELDS = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)
_WORDS = re.compile(r"\w+")


def relevance(query: str, document: str) -> float:
    """A stable score in (0, 1): the share of the query's words found in the document, with a
    small pair-specific jitter so that ties still have an order."""
    q = set(_WORDS.findall(query.lower()))
    d = set(_WORDS.findall(document.lower()))
    overlap = len(q & d) / len(q) if q else 0.0
    jitter = (zlib.crc32(f"{query}\0{document}".encode()) % 1000) / 1000 - 0.5
    return 1 / (1 + math.exp(-(6 * overlap - 3 + jitter)))


def _text(item: object) -> str:
    """A score input as text: a string, or the text parts of a multimodal `{"content": [...]}`."""
    if isinstance(item, str):
        return item
    parts = item.get("content") or [] if isinstance(item, dict) else []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


def _inputs(value: object, name: str) -> list:
    if isinstance(value, (str, dict)):
        return [value]
    if isinstance(value, list) and all(isinstance(v, (str, dict)) for v in value):
        return value
    raise bad_request(f"{name}: Input should be a string or a list of strings", name)


def pairs(first: list, second: list) -> list[tuple[object, object]]:
    """1:1, 1:N or N:N, as vLLM pairs score inputs."""
    if not first:
        raise context_error("At least one text element must be given")
    if not second:
        raise context_error("At least one text_pair element must be given")
    if len(first) > 1 and len(first) != len(second):
        raise context_error("Input lengths must be either 1:1, 1:N or N:N")
    if len(first) == 1:
        return [(first[0], d) for d in second]
    return list(zip(first, second, strict=True))


class Scoring:
    """The score and rerank endpoints of one cross-encoder engine."""

    def __init__(self, cfg: Config, engine: Engine, gen: Generator) -> None:
        self.cfg, self.engine, self.gen = cfg, engine, gen

    def _request_id(self, req: Request) -> str:
        return "score-" + (req.headers.get("x-request-id") or uuid.uuid4().hex)

    async def _prefill(
        self, conn: Connection, body: dict, pairs_: list[tuple[object, object]], operation: str
    ) -> list[int]:
        """Run every pair through the engine (prefill only); their token counts."""
        counts = []
        for q, d in pairs_:
            n = tokenizer.count(tokenizer.score_pair(_text(q), _text(d)))
            if n > self.cfg.max_model_len:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.cfg.max_model_len} tokens. "
                    f"However, you requested {n} tokens in the input for {operation}. "
                    "Please reduce the length of the input.",
                    "BadRequestError",
                    "input_tokens",
                )
            counts.append(n)
        seq = Sequence(sum(counts), priority_of(self.cfg, body))
        try:
            await self.gen._admit_errors(self.gen.run(conn, seq, 0, None, None))
        except BaseException:
            self.gen._abort(seq)
            raise
        self.gen._finish(seq, "stop")
        return counts

    async def score(self, req: Request, conn: Connection, body: dict, model: str, rid: str) -> None:
        names = next((p for p in SCORE_FIELDS if p[0] in body and p[1] in body), None)
        if names is None:
            raise bad_request("text_1 and text_2: Field required", "text_1")
        todo = pairs(_inputs(body[names[0]], names[0]), _inputs(body[names[1]], names[1]))
        counts = await self._prefill(conn, body, todo, "score")
        total = sum(counts)
        conn.send_json(
            200,
            {
                "id": self._request_id(req),
                "object": "list",
                "created": int(time.time()),
                "model": self.cfg.served_names[0],
                "data": [
                    {"index": i, "object": "score", "score": relevance(_text(q), _text(d))}
                    for i, (q, d) in enumerate(todo)
                ],
                "usage": {
                    "prompt_tokens": total,
                    "total_tokens": total,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            },
        )

    async def rerank(
        self, req: Request, conn: Connection, body: dict, model: str, rid: str
    ) -> None:
        query = body.get("query")
        if not isinstance(query, (str, dict)):
            raise bad_request("query: Field required", "query")
        docs = _inputs(body.get("documents"), "documents")
        top_n = body.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool):
            raise bad_request("top_n: Input should be a valid integer", "top_n")
        todo = pairs([query], docs)
        # vLLM's length check names every non-score request "embedding generation".
        counts = await self._prefill(conn, body, todo, "embedding generation")
        results = [
            {
                "index": i,
                "document": {"text": d, "multi_modal": None}
                if isinstance(d, str)
                else {"text": None, "multi_modal": d.get("content", [])},
                "relevance_score": relevance(_text(query), _text(d)),
            }
            for i, d in enumerate(docs)
        ]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if 0 < top_n < len(docs):
            results = results[:top_n]
        total = sum(counts)
        conn.send_json(
            200,
            {
                "id": self._request_id(req),
                "model": self.cfg.served_names[0],
                "usage": {"prompt_tokens": total, "total_tokens": total},
                "results": results,
            },
        )
