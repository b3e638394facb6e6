"""Routing and the small endpoints: /health, /v1/models, /version, /metrics, /load,
/tokenize, /detokenize; auth and JSON error rendering for all of them."""

from __future__ import annotations

import json
import os
import time

from engine_sim import VLLM_VERSION, tokenizer
from engine_sim.cli import Config
from engine_sim.engine import Engine
from engine_sim.errors import ApiError, bad_request, model_not_found, pydantic_error
from engine_sim.generation import Generator, new_request_id
from engine_sim.http import Connection, Request
from engine_sim.messages import Messages
from engine_sim.responses import Responses
from engine_sim.scoring import Scoring

NOT_FOUND = b'{"detail":"Not Found"}'
METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
RESPONSES = "/v1/responses/"


class App:
    """The HTTP application: what `vllm serve`'s FastAPI app answers."""

    def __init__(self, cfg: Config, engine: Engine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.gen = Generator(cfg, engine, self._request_done)
        self.created = int(time.time())
        self.names = set(cfg.served_names)
        self.server_load = 0
        self.requests_done = 0
        self.on_request_done = lambda n: None  # fault injection hooks in here
        self.auth = {f"Bearer {k}" for k in cfg.api_keys}
        self.responses = Responses(cfg, engine, self.gen)
        self.messages = Messages(cfg, engine, self.gen, self._model)
        self.scoring = Scoring(cfg, engine, self.gen)
        # Like vLLM, each kind of model only has its own routes: the others are 404.
        if cfg.embedding:
            gen_routes = {"/v1/embeddings": self.gen.embeddings}
        elif cfg.scoring:
            gen_routes = {path: self.scoring.score for path in ("/score", "/v1/score")}
            gen_routes.update(
                {path: self.scoring.rerank for path in ("/rerank", "/v1/rerank", "/v2/rerank")}
            )
        else:
            gen_routes = {
                "/v1/chat/completions": self.gen.chat,
                "/v1/completions": self.gen.completions,
                "/v1/responses": self.responses.create,
            }
        self.post_model_routes = gen_routes
        # The Anthropic routes resolve the model themselves (their errors have Anthropic's shape).
        self.anthropic_routes = (
            {}
            if cfg.embedding or cfg.scoring
            else {
                "/v1/messages": self.messages.create,
                "/v1/messages/count_tokens": self.messages.count_tokens,
            }
        )
        self.get_routes = {
            "/health": self.health,
            "/v1/models": self.models,
            "/version": self.version,
            "/metrics": self.metrics,
            "/load": self.load,
            "/ping": self.health,
        }
        self.post_routes = {
            "/tokenize": self.tokenize,
            "/detokenize": self.detokenize,
            "/ping": self.health,
        }
        if cfg.enable_lora and cfg.runtime_lora:
            self.post_routes["/v1/load_lora_adapter"] = self.load_lora
            self.post_routes["/v1/unload_lora_adapter"] = self.unload_lora
        self._models_body = b""  # made on first use, again after an adapter comes or goes

    def _request_done(self) -> None:
        self.requests_done += 1
        self.on_request_done(self.requests_done)

    async def __call__(self, req: Request, conn: Connection) -> None:
        if self.engine.hung:
            await self.engine.pause_if_hung()
        path = req.path
        if (
            self.auth
            and path.startswith("/v1")
            and req.headers.get("authorization") not in self.auth
        ):
            conn.send(401, b'{"error":"Unauthorized"}')
            return
        try:
            await self._route(req, conn, path)
        except ApiError as err:
            conn.send(err.status, json.dumps(err.body()).encode())

    async def _route(self, req: Request, conn: Connection, path: str) -> None:
        method = req.method
        if method == "POST" and path in self.post_model_routes:
            await self._generate(req, conn, self.post_model_routes[path])
        elif method == "POST" and path in self.anthropic_routes:
            await self._generate_anthropic(req, conn, self.anthropic_routes[path])
        elif method == "GET" and path in self.get_routes:
            await self.get_routes[path](req, conn)
        elif method == "POST" and path in self.post_routes:
            await self.post_routes[path](req, conn)
        elif path.startswith(RESPONSES) and "/v1/responses" in self.post_model_routes:
            await self._stored_response(req, conn, path[len(RESPONSES) :])
        elif (
            path in self.get_routes
            or path in self.post_routes
            or path in self.post_model_routes
            or path in self.anthropic_routes
        ):
            conn.send(405, METHOD_NOT_ALLOWED)
        else:
            conn.send(404, NOT_FOUND)

    async def _stored_response(self, req: Request, conn: Connection, rest: str) -> None:
        """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel; nothing else (vLLM
        serves no DELETE and no /input_items)."""
        response_id, _, action = rest.partition("/")
        if not response_id or action not in ("", "cancel"):
            conn.send(404, NOT_FOUND)
        elif action == "" and req.method == "GET":
            await self.responses.retrieve(req, conn, response_id)
        elif action == "cancel" and req.method == "POST":
            await self.responses.cancel(req, conn, response_id)
        else:
            conn.send(405, METHOD_NOT_ALLOWED)

    def _body(self, req: Request) -> dict:
        try:
            body = json.loads(req.body)
        except ValueError as exc:
            raise bad_request(f"JSON decode error: {exc}") from None
        if not isinstance(body, dict):
            raise pydantic_error(
                "body",
                "model_attributes_type",
                "Input should be a valid dictionary or object to extract fields from",
                body,
            )
        return body

    def _model(self, body: dict) -> str:
        """The served name the request addresses; vLLM defaults to the first one."""
        model = body.get("model")
        if model is None:
            return self.cfg.served_names[0]
        if not isinstance(model, str) or (
            model not in self.names and model not in self.engine.adapters
        ):
            # Adapters are never among the aliases vLLM lists.
            raise model_not_found(str(model), self.cfg.served_names)
        return model

    async def _generate(self, req: Request, conn: Connection, handler) -> None:
        body = self._body(req)
        model = self._model(body)
        self.server_load += 1
        try:
            await handler(req, conn, body, model, new_request_id(req))
        finally:
            self.server_load -= 1

    async def _generate_anthropic(self, req: Request, conn: Connection, handler) -> None:
        body = self._body(req)
        self.server_load += 1
        try:
            await handler(req, conn, body, new_request_id(req))
        finally:
            self.server_load -= 1

    # --- small endpoints -------------------------------------------------------------------

    async def health(self, req: Request, conn: Connection) -> None:
        conn.send(503 if self.engine.dead else 200, b"", "application/json")

    def _model_list(self) -> dict:
        """A card per served name, then one per adapter in load order (its parent: the
        first served name; its root: the path it was loaded from; no max_model_len)."""
        cards = []
        base = self.cfg.served_names[0]
        entries = [(n, self.cfg.model, None, self.cfg.max_model_len) for n in self.cfg.served_names]
        entries += [(n, path, base, None) for n, path in self.engine.adapters.paths.items()]
        for name, root, parent, max_len in entries:
            perm = {
                "id": "modelperm-" + os.urandom(16).hex(),
                "object": "model_permission",
                "created": self.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "vllm",
                    "root": root,
                    "parent": parent,
                    "max_model_len": max_len,
                    "permission": [perm],
                }
            )
        return {"object": "list", "data": cards}

    async def models(self, req: Request, conn: Connection) -> None:
        if not self._models_body:
            self._models_body = json.dumps(self._model_list(), separators=(",", ":")).encode()
        conn.send(200, self._models_body)

    async def load_lora(self, req: Request, conn: Connection) -> None:
        said = await self.engine.adapters.load(self._body(req))
        self._models_body = b""
        conn.send(200, said.encode(), None)

    async def unload_lora(self, req: Request, conn: Connection) -> None:
        said = self.engine.adapters.unload(self._body(req))
        self._models_body = b""
        conn.send(200, said.encode(), None)

    async def version(self, req: Request, conn: Connection) -> None:
        conn.send(200, b'{"version":"%b"}' % VLLM_VERSION.encode())

    async def metrics(self, req: Request, conn: Connection) -> None:
        conn.send(
            200, self.engine.render_metrics().encode(), "text/plain; version=0.0.4; charset=utf-8"
        )

    async def load(self, req: Request, conn: Connection) -> None:
        conn.send(200, b'{"server_load":%d}' % self.server_load)

    async def tokenize(self, req: Request, conn: Connection) -> None:
        body = self._body(req)
        self._model(body)
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise bad_request("messages: Input should be a valid list", "messages")
            text = tokenizer.chat_prompt(
                msgs,
                body.get("tools"),
                body.get("add_generation_prompt", True),
                body.get("continue_final_message") is True,
            )
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise bad_request("prompt or messages: Field required", "prompt")
        toks = tokenizer.split(text)
        ids = [tokenizer.token_id(t) for t in toks]
        conn.send(
            200,
            json.dumps(
                {
                    "count": len(ids),
                    "max_model_len": self.cfg.max_model_len,
                    "tokens": ids,
                    "token_strs": toks if body.get("return_token_strs") else None,
                }
            ).encode(),
        )

    async def detokenize(self, req: Request, conn: Connection) -> None:
        body = self._body(req)
        self._model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise bad_request("tokens: Input should be a valid list of integers", "tokens")
        conn.send(200, json.dumps({"prompt": tokenizer.decode(ids)}).encode())
