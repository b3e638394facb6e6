"""A deterministic, cheap tokenizer and text generator.

Not a real BPE: words and punctuation (with their leading whitespace) are tokens, which
is close enough to real token counts for accounting tests, and every text round-trips
(`"".join(token_strs) == text`). Ids are a CRC of the token string, so they are stable
across processes; detokenizing works for every token this process has seen or generated.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator

# Special tokens first so a chat template's markers count as one token each, like a real
# tokenizer's added tokens.
_TOKEN_RE = re.compile(r"\s*<\|[a-z_]+\|>|\s*\w+|\s*[^\w\s]|\s+")
VOCAB_SIZE = 151_936
_MAX_CACHED = 500_000
_ids: dict[str, int] = {}
_strs: dict[int, str] = {}


def token_id(tok: str) -> int:
    """Stable id of one token string; remembers it so /detokenize can map it back."""
    tid = _ids.get(tok)
    if tid is None:
        tid = zlib.crc32(tok.encode()) % VOCAB_SIZE
        if len(_ids) < _MAX_CACHED:  # bound memory under adversarial input
            _ids[tok] = tid
            _strs[tid] = tok
    return tid


def split(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def encode(text: str) -> list[int]:
    return [token_id(t) for t in _TOKEN_RE.findall(text)]


def count(text: str) -> int:
    return len(_TOKEN_RE.findall(text))


def decode(ids: list[int]) -> str:
    return "".join(_strs.get(i, f"<|unk_{i}|>") for i in ids)


# Content-part types that are text to a chat template: chat's own, and the Responses API's
# input and output text (vLLM's chat utils read all three as text).
TEXT_PARTS = ("text", "input_text", "output_text")


def _content_text(content: object) -> str:
    """Message content as text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:  # type: ignore[union-attr]
        if isinstance(part, dict) and part.get("type") in TEXT_PARTS:
            parts.append(str(part.get("text", "")))
        elif isinstance(part, dict):
            parts.append("<|image_pad|>")  # non-text parts cost a token, like a placeholder
    return "".join(parts)


def chat_prompt(
    messages: list[dict],
    tools: list | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """A ChatML-style template: what the engine 'sees' for a chat request. With
    ``continue_final_message`` the last message stays open (no end marker), so the model
    continues it, as vLLM does."""
    out = []
    if tools:
        out.append(
            "<|im_start|>system\n# Tools\n" + json.dumps(tools, sort_keys=True) + "<|im_end|>\n"
        )
    for m in messages:
        text = _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"], sort_keys=True)
        out.append(f"<|im_start|>{m.get('role', 'user')}\n{text}<|im_end|>\n")
    if continue_final_message and out:
        out[-1] = out[-1].removesuffix("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


_WORDS = (
    "the of and to in is it that for on with as was at by this be from or an are not have "
    "model token engine request stream batch cache memory latency answer question simple "
    "system value result data time first next each other many more most some such only "
    "new good great small large long short early late high low right left open close "
    "make take give find think know look want use work call try ask need feel become "
    "leave put mean keep let begin seem help show hear play run move live believe hold "
    "bring happen write provide sit stand lose pay meet include continue set learn change "
    "lead understand watch follow stop create speak read allow add spend grow offer "
    "remember love consider appear buy wait serve die send expect build stay fall cut "
    "reach kill remain suggest raise pass sell require report decide pull"
).split()
_REASON_WORDS = (
    "let me think about this step by step first consider the question then check what "
    "follows so the answer should be clear now verify it once more because details matter"
).split()


def _lcg(seed: int) -> Iterator[int]:
    # Numerical Recipes LCG: deterministic, fast, good enough for picking words.
    x = seed & 0xFFFFFFFF
    while True:
        x = (1664525 * x + 1013904223) & 0xFFFFFFFF
        yield x >> 8


def generate(seed: int, n: int, reasoning: bool = False) -> list[str]:
    """`n` token strings of plausible-looking text, fixed by `seed`."""
    words = _REASON_WORDS if reasoning else _WORDS
    rnd = _lcg(seed)
    out: list[str] = []
    since_stop = 0
    capital = True
    for i in range(n):
        r = next(rnd)
        if since_stop > 6 and r % 9 == 0 and i < n - 1:
            capital = r % 2 == 1
            out.append("." if capital else ",")
            since_stop = 0
            continue
        w = words[r % len(words)]
        out.append((" " if i else "") + (w.capitalize() if capital else w))
        capital = False
        since_stop += 1
    return out


def seed_of(text: str) -> int:
    return zlib.crc32(text.encode())


def score_pair(query: str, document: str) -> str:
    """What a cross-encoder sees for one (query, document) pair: both texts between its
    special tokens, like a BERT-style `[CLS] q [SEP] d [SEP]` (3 tokens more than the texts)."""
    return f"<|cls|>{query}<|sep|>{document}<|sep|>"
