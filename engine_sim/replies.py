"""What the simulated model answers: a deterministic plan of tokens for one request.

The plan is fixed before decoding starts (from the prompt text, request options and
knobs); the decode loop then only releases it token by token, so usage always equals what
was streamed.
"""

from __future__ import annotations

import json
import os

from engine_sim import tokenizer


class ToolCall:
    """A tool call the model makes: one 'header' token (the name) then argument tokens."""

    __slots__ = ("id", "name", "args")

    def __init__(self, name: str, arguments: str) -> None:
        self.id = "chatcmpl-tool-" + os.urandom(8).hex()
        self.name = name
        self.args = tokenizer.split(arguments)


class Reply:
    """Token plan: reasoning tokens, then content tokens or one tool call."""

    __slots__ = ("reasoning", "content", "tool", "finish_reason", "stop_reason", "stop_in_token")

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool: ToolCall | None = None
        self.finish_reason = "stop"
        self.stop_reason: str | None = None
        # The stop string fell inside the last token, which keeps the text before it.
        self.stop_in_token = False

    def __len__(self) -> int:
        tool = 1 + len(self.tool.args) if self.tool else 0
        return len(self.reasoning) + len(self.content) + tool


def natural_length(seed: int, lo: int, hi: int) -> int:
    """How long the model 'wants' to talk, fixed by the prompt."""
    lo = max(1, lo)
    return lo + seed % (max(lo, hi) - lo + 1)


def _example_value(name: str, schema: dict, seed: int) -> object:
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type", "string")
    if kind == "integer":
        return seed % 100
    if kind == "number":
        return round((seed % 1000) / 10, 1)
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        return {}
    return "".join(tokenizer.generate(seed ^ len(name), 2)).strip()


def tool_arguments(tool: dict, seed: int) -> str:
    """Arguments that fit the tool's JSON schema (every property, required or not)."""
    params = (tool.get("function") or {}).get("parameters") or {}
    props = params.get("properties") or {}
    args = {k: _example_value(k, v if isinstance(v, dict) else {}, seed) for k, v in props.items()}
    return json.dumps(args)


def pick_tool(tools: list[dict], tool_choice: object, messages: list | None = None) -> dict | None:
    """The tool to call (chat-format tools), or None when the model should answer in text.

    Left to choose ("auto"), the model answers in text once the last message is a tool
    result, so an agent's call-then-answer loop ends like it does with a real model."""
    if tool_choice == "none" or not tools:
        return None
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        return next((t for t in tools if (t.get("function") or {}).get("name") == wanted), None)
    last = messages[-1] if messages else None
    if tool_choice == "auto" and isinstance(last, dict) and last.get("role") == "tool":
        return None
    return tools[0]


def _cut(tokens: list[str], budget: int) -> tuple[list[str], int]:
    kept = tokens[: max(0, budget)]
    return kept, budget - len(kept)


def _apply_stop(reply: Reply, stop: list[str]) -> None:
    """End content at the first stop string (excluded from the output), as vLLM does."""
    text = ""
    for i, tok in enumerate(reply.content):
        text += tok
        for s in stop:
            at = text.find(s)
            if s and at >= 0:
                keep = at - (len(text) - len(tok))
                # A token left with no text is not streamed and not counted: no content-less
                # chunk is ever a token here (a gateway counts streamed tokens by chunks).
                reply.content = reply.content[:i] + ([tok[:keep]] if keep > 0 else [])
                reply.stop_reason = s
                reply.stop_in_token = keep > 0
                return


def plan(
    seed: int,
    *,
    max_tokens: int,
    natural: int,
    reasoning_tokens: int = 0,
    tool: dict | None = None,
    stop: list[str] | None = None,
) -> Reply:
    """Build the reply, cut to `max_tokens` (then finish_reason is 'length')."""
    r = Reply()
    budget = max_tokens
    r.reasoning, budget = _cut(tokenizer.generate(seed, reasoning_tokens, reasoning=True), budget)
    if tool is not None:
        name = (tool.get("function") or {}).get("name", "tool")
        if budget > 0:
            r.tool = ToolCall(name, tool_arguments(tool, seed))
            full = len(r.tool.args)
            r.tool.args, budget = _cut(r.tool.args, budget - 1)
            r.finish_reason = "length" if len(r.tool.args) < full else "tool_calls"
        else:
            r.finish_reason = "length"
        return r
    # The end-of-sequence token comes after `natural` tokens; if it does not fit in the
    # budget the reply was cut, which vLLM reports as 'length' (ignore_eos always is).
    r.content, _ = _cut(tokenizer.generate(seed >> 3, natural), budget)
    if stop:
        _apply_stop(r, stop)
    if r.stop_reason is None and natural >= budget:
        r.finish_reason = "length"
    return r
