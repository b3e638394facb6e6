"""The request fields an admin may allow per catalogue model.

The gateway's engine shield (gateway/shield.py) refuses these fields from tenants, because
they reach into the engine's prompt rendering or its processors (a Jinja template of the
request's own, keyword arguments of the tokenizer or of a multimodal processor); a model's
``allowed_request_fields`` lets them through for that model. The catalogue validates that
list here, the gateway reads it from its snapshot: both know the same names.
"""

from __future__ import annotations

import re
from typing import Any

from django.core.exceptions import ValidationError

# Field -> what allowing it lets a tenant do (shown in the console's form and the docs).
ALLOWABLE = {
    "chat_template": "send a Jinja chat template of its own (the engine also needs "
    "--trust-request-chat-template)",
    "chat_template_kwargs": "pass any key to the chat template and its renderer",
    "mm_processor_kwargs": "pass keyword arguments to the model's multimodal processor",
    "media_io_kwargs": "pass keyword arguments to the engine's image, audio and video loaders",
    "vllm_xargs": "pass arguments to the engine's custom extensions",
    "session_id": "name a session the engine's KV-cache connectors may key on",
}
# One key of chat_template_kwargs allowed on its own: "chat_template_kwargs.<key>".
TEMPLATE_KWARGS = "chat_template_kwargs"
TEMPLATE_KWARG_PREFIX = TEMPLATE_KWARGS + "."
# Keys every model's chat_template_kwargs accepts (scalar values only): the switches chat
# templates commonly read. Keys the renderer itself interprets (chat_template, tokenize,
# tools, documents, return_dict, …) are never among them.
SAFE_TEMPLATE_KWARGS = frozenset(("enable_thinking", "thinking", "reasoning_effort", "instruction"))
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}\Z")


def allowance_problems(value: Any) -> list[str]:
    """What is wrong with a model's list of allowed request fields (empty: nothing)."""
    if not isinstance(value, list):
        return ['Give a list of field names, e.g. ["chat_template"].']
    problems = []
    for entry in value:
        if not isinstance(entry, str):
            problems.append(f"{entry!r} is not a field name.")
        elif entry.startswith(TEMPLATE_KWARG_PREFIX):
            if not _KEY.match(entry.removeprefix(TEMPLATE_KWARG_PREFIX)):
                problems.append(f"{entry}: the key must be a plain name (letters, digits, _).")
        elif entry not in ALLOWABLE:
            names = ", ".join(sorted(ALLOWABLE))
            problems.append(
                f"{entry} cannot be allowed: give one of {names}, or chat_template_kwargs.<key>."
            )
    if len(set(value)) != len(value):
        problems.append("Each field may appear once.")
    return problems


def validate_allowed_fields(value: Any) -> None:
    """Django validator for ``CatalogModel.allowed_request_fields``."""
    problems = allowance_problems(value)
    if problems:
        raise ValidationError(problems)
