"""The engine shield: what of a request Tollgate lets reach a shared engine.

Every generation, embedding and rerank request passes ``check`` before admission: each
field is looked up in its API's policy (gateway/shield_policy.py) and refused, bounded,
dropped or passed on. A refusal is a 400 in OpenAI's shape (Anthropic's on /v1/messages:
gateway/messages.py rewrites it), naming the field and the bound; it costs the tenant
nothing and the engine never sees it.

The cost for an ordinary body is one dict lookup per field (a few microseconds). Structured
outputs and tools are written as JSON first (in C) and their brackets, commas and patterns
counted: only one that could pass a bound is walked, iteratively, stopping at the first
bound passed (its size already bounded, so the walk is too).

Also here: which paths outside ``/v1`` are the engine's own routes (``engine_path``), which
the gateway answers itself with a 404 rather than let the console answer them.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

import orjson
from django.conf import settings

from core.request_fields import SAFE_TEMPLATE_KWARGS, TEMPLATE_KWARG_PREFIX, TEMPLATE_KWARGS
from gateway.errors import error_body
from gateway.shield_policy import ENGINE_PATHS, ENGINE_PREFIXES, POLICY, Rule
from gateway.state import ModelInfo

Problem = tuple[int, bytes]

# JSON-schema keywords listing alternatives: an engine's grammar compile grows faster than
# linearly with them (vLLM 0.32 on the CPU test machine: 7,000 enum values 0.3 s, 20,000
# values 6 s, 100,000 over three minutes, all other requests on the engine waiting).
ALTERNATIVES = ("enum", "anyOf", "oneOf")
KEYWORDS = frozenset((*ALTERNATIVES, "pattern", "patternProperties"))  # what the walk reads
REGEX_MAX_CHARS = 4096
# orjson reads JSON nested 1,024 levels deep but writes only 254: a body between the two
# would fail (a 500) wherever the gateway writes it again for the engine.
JSON_MAX_DEPTH = 254
TEMPLATE_VALUE_MAX_CHARS = 256
TOOLS_SCHEMA_SHARE = 4  # all of a request's tool schemas: at most this many schemas' bytes
STRUCTURED_KEYS = frozenset(
    (
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
    )
)
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Counted repetitions in EBNF/GBNF ({m,n}) and Lark (~ m..n) grammars.
GRAMMAR_COUNTS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
REGEX_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


@dataclass(frozen=True, slots=True)
class Bounds:
    """The shield's tunable bounds (config/settings.py)."""

    n: int
    logprobs: int
    items: int
    tools: int
    schema_bytes: int
    schema_depth: int
    choices: int
    repeat: int

    @classmethod
    def from_settings(cls) -> Bounds:
        return cls(
            n=settings.TOLLGATE_MAX_N,
            logprobs=settings.TOLLGATE_SHIELD_MAX_LOGPROBS,
            items=settings.TOLLGATE_SHIELD_MAX_ITEMS,
            tools=settings.TOLLGATE_SHIELD_MAX_TOOLS,
            schema_bytes=settings.TOLLGATE_SHIELD_MAX_SCHEMA_BYTES,
            schema_depth=settings.TOLLGATE_SHIELD_MAX_SCHEMA_DEPTH,
            choices=settings.TOLLGATE_SHIELD_MAX_CHOICES,
            repeat=settings.TOLLGATE_SHIELD_MAX_REPEAT,
        )


def too_deep(body: bytes, payload: dict) -> bool:
    """Whether a parsed body nests deeper than ``JSON_MAX_DEPTH``. Only a body with that many
    brackets can (counted in C); only such a body is written again to find out."""
    if body.count(b"[") + body.count(b"{") <= JSON_MAX_DEPTH:
        return False
    try:
        orjson.dumps(payload)
    except TypeError:
        return True
    return False


def refuse(message: str, param: str, code: str = "invalid_value") -> Problem:
    return 400, error_body(message, param=param, code=code)


def check(payload: dict, api: str, model: ModelInfo, bounds: Bounds) -> tuple[Problem | None, bool]:
    """(the refusal, or None; whether fields were dropped from ``payload``)."""
    rules = COMPILED[api]
    dropped = None
    for name, value in payload.items():
        entry = rules.get(name)
        if entry is None:
            return refuse(
                f"Unrecognized request argument supplied: {name}. This appliance forwards "
                "only the fields its engine policy lists for this API.",
                name,
                "unknown_parameter",
            ), False
        check_field, rule = entry
        if check_field is None or value is None:  # passed on; null is "not given"
            continue
        if check_field is DROP:
            dropped = [*(dropped or ()), name]
            continue
        problem = check_field(name, value, rule, model, bounds)
        if problem is not None:
            return problem, False
    for name in dropped or ():
        del payload[name]
    return None, bool(dropped)


# --- Plain fields ----------------------------------------------------------------------------


def _high(rule: Rule, model: ModelInfo, bounds: Bounds) -> tuple[int, str]:
    """A rule's upper bound, and how a message explains it."""
    if rule.high == "context":
        return model.context_length, " (the model's context length)"
    if isinstance(rule.high, str):
        return getattr(bounds, rule.high), " on this appliance"
    return rule.high, " on this appliance"


def _whole(name: str, value: Any, rule: Rule, model: ModelInfo, bounds: Bounds) -> Problem | None:
    high, why = _high(rule, model, bounds)
    if isinstance(value, int) and not isinstance(value, bool) and rule.low <= value <= high:
        return None
    return refuse(f"`{name}` must be a whole number from {rule.low} to {high}{why}.", name)


def _items(name: str, value: Any, rule: Rule, model: ModelInfo, bounds: Bounds) -> Problem | None:
    high, why = _high(rule, model, bounds)
    if isinstance(value, (list, dict)) and len(value) > high:
        return refuse(f"`{name}` may hold at most {high} items{why}.", name)
    return None


def _logit_bias(name: str, value: Any, rule: Rule, *_: Any) -> Problem | None:
    if not isinstance(value, dict):
        return refuse(f"`{name}` must be an object of token ids to numbers.", name)
    if len(value) > rule.high:
        return refuse(f"`{name}` may hold at most {rule.high} items on this appliance.", name)
    for bias in value.values():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or abs(bias) > 100:
            return refuse(f"Each value of `{name}` must be a number from -100 to 100.", name)
    return None


def _refused(name: str, value: Any, rule: Rule, *_: Any) -> Problem:
    return refuse(
        f"`{name}` is not accepted on this appliance: {rule.note}.", name, "unsupported_parameter"
    )


def _not_allowed(name: str, model: ModelInfo, aside: str = "") -> Problem:
    return refuse(
        f"`{name}` is not accepted for the model `{model.served_name}`: ask your administrator "
        f"to allow it for this model{aside}.",
        name.partition(".")[0],
        "unsupported_parameter",
    )


def _guarded(name: str, value: Any, rule: Rule, model: ModelInfo, _: Bounds) -> Problem | None:
    return None if name in model.allowed_fields else _not_allowed(name, model)


def _template_kwargs(
    name: str, value: Any, rule: Rule, model: ModelInfo, bounds: Bounds
) -> Problem | None:
    if TEMPLATE_KWARGS in model.allowed_fields:
        return None
    if not isinstance(value, dict):
        return refuse(f"`{name}` must be an object.", name)
    for key, given in value.items():
        if key in SAFE_TEMPLATE_KWARGS:
            scalar = given is None or isinstance(given, (bool, int, float))
            if not scalar and not (
                isinstance(given, str) and len(given) <= TEMPLATE_VALUE_MAX_CHARS
            ):
                return refuse(
                    f"`{name}.{key}` must be true, false, a number or a string of at most "
                    f"{TEMPLATE_VALUE_MAX_CHARS} characters.",
                    name,
                )
        elif TEMPLATE_KWARG_PREFIX + key not in model.allowed_fields:
            safe = ", ".join(sorted(SAFE_TEMPLATE_KWARGS))
            return _not_allowed(f"{name}.{key}", model, f" (every model takes {safe})")
    return None


# --- Structured outputs --------------------------------------------------------------------


def _too_big(value: Any, path: str, limit: int) -> tuple[str | None, bytes]:
    """(what is wrong with its size, or None; the value written as JSON)."""
    raw = orjson.dumps(value)
    if len(raw) > limit:
        return f"`{path}` is {len(raw)} bytes: at most {limit} are accepted on this appliance.", raw
    return None, raw


def schema_problem(value: Any, path: str, bounds: Bounds) -> str | None:
    """What is wrong with a JSON schema an engine would compile (None: nothing)."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return f"`{path}` must be a JSON schema: an object, or the JSON text of one."
    if not isinstance(value, dict):
        return f"`{path}` must be a JSON schema: an object."
    problem, raw = _too_big(value, path, bounds.schema_bytes)
    return problem or (_walk(value, path, bounds) if _worth_walking(raw, bounds) else None)


def _worth_walking(raw: bytes, bounds: Bounds) -> bool:
    """Whether a schema written as ``raw`` could break a bound the walk checks: it cannot nest
    deeper than it has brackets, list more alternatives than it has commas, or hold a pattern
    without naming one (counted in C: most schemas need no walk at all)."""
    return (
        raw.count(b"{") + raw.count(b"[") > bounds.schema_depth
        or raw.count(b",") >= bounds.choices
        or b'"pattern' in raw
    )


def _walk(root: dict, path: str, bounds: Bounds) -> str | None:
    """Depth, alternatives and patterns of a schema (its size is already bounded)."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > bounds.schema_depth:
            return (
                f"`{path}` is nested more than {bounds.schema_depth} levels deep: the limit on "
                "this appliance."
            )
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, dict):
            problem = _keywords(node, path, bounds)
            if problem:
                return problem
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return None


def _keywords(node: dict, path: str, bounds: Bounds) -> str | None:
    if KEYWORDS.isdisjoint(node):
        return None
    for key in ALTERNATIVES:
        listed = node.get(key)
        if isinstance(listed, list) and len(listed) > bounds.choices:
            return (
                f"`{key}` in `{path}` lists {len(listed)} alternatives: at most {bounds.choices} "
                "on this appliance."
            )
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        problem = regex_problem(pattern, f"{path}` pattern `{pattern[:40]}", bounds)
        if problem:
            return problem
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        for pattern in patterns:
            problem = regex_problem(pattern, f"{path}` patternProperties `{pattern[:40]}", bounds)
            if problem:
                return problem
    return None


def regex_problem(pattern: Any, path: str, bounds: Bounds) -> str | None:
    """A regular expression an engine would compile: bounded in length and in how far its
    counted repetitions multiply (``(a{100}){100}`` is 10,000 copies). Its syntax is the
    engine's to judge (engines accept more than Python does)."""
    if not isinstance(pattern, str):
        return f"`{path}` must be a string."
    if len(pattern) > REGEX_MAX_CHARS:
        return f"`{path}` is longer than {REGEX_MAX_CHARS} characters: the limit on this appliance."
    copies = regex_copies(pattern)
    if copies is None:
        return f"`{path}` is not a regular expression: its parentheses do not match."
    if copies > bounds.repeat:
        return (
            f"`{path}` repeats too much: its counted repetitions multiply to {copies}, at most "
            f"{bounds.repeat} on this appliance."
        )
    return None


def regex_copies(pattern: str) -> int | None:
    """The largest product of nested counted repetitions in a pattern (``{m}``, ``{m,}``,
    ``{m,n}``), or None when its groups do not balance. One pass: escapes and character
    classes are skipped; each open group keeps the largest product inside it."""
    groups, last, at, end = [1], 1, 0, len(pattern)
    while at < end:
        char = pattern[at]
        if char == "\\":
            last, at = 1, at + 2
        elif char == "[":
            at = _class_end(pattern, at + 1)
            last = 1
        elif char == "(":
            groups.append(1)
            last, at = 1, at + 1
        elif char == ")":
            if len(groups) == 1:
                return None
            last = groups.pop()
            groups[-1] = max(groups[-1], last)
            at += 1
        elif char == "{" and (counted := REGEX_COUNT.match(pattern, at)):
            low, high = counted.groups()
            count = int(high) if high else int(low)
            last *= max(count, 1)
            groups[-1] = max(groups[-1], last)
            at = counted.end()
        else:
            last, at = 1, at + 1
    return groups[0] if len(groups) == 1 else None


def _class_end(pattern: str, at: int) -> int:
    """Where a character class that opened before ``at`` ends (after its ``]``)."""
    if at < len(pattern) and pattern[at] == "^":
        at += 1
    if at < len(pattern) and pattern[at] == "]":
        at += 1  # a ] first in the class is a literal
    while at < len(pattern) and pattern[at] != "]":
        at += 2 if pattern[at] == "\\" else 1
    return at + 1


def grammar_problem(grammar: Any, path: str, bounds: Bounds) -> str | None:
    if not isinstance(grammar, str) or not grammar.strip():
        return f"`{path}` must be a grammar (text)."
    if len(grammar) > bounds.schema_bytes:
        return f"`{path}` is longer than {bounds.schema_bytes} characters: the limit here."
    for match in GRAMMAR_COUNTS.finditer(grammar):
        count = max(int(n) for n in match.groups() if n)
        if count > bounds.repeat:
            return (
                f"`{path}` repeats something {count} times: at most {bounds.repeat} on this "
                "appliance."
            )
    return None


def choice_problem(choice: Any, path: str, bounds: Bounds) -> str | None:
    if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
        return f"`{path}` must be a non-empty list of strings."
    if len(choice) > bounds.choices:
        return f"`{path}` may hold at most {bounds.choices} choices on this appliance."
    return _too_big(choice, path, bounds.schema_bytes)[0]


def tag_problem(tag: Any, path: str, bounds: Bounds) -> str | None:
    """vLLM's structural tags: JSON (text, or an object) holding schemas."""
    if isinstance(tag, str):
        try:
            tag = orjson.loads(tag)
        except orjson.JSONDecodeError:
            return f"`{path}` must be a structural tag (JSON)."
    if not isinstance(tag, (dict, list)):
        return f"`{path}` must be a structural tag (JSON)."
    problem, raw = _too_big(tag, path, bounds.schema_bytes)
    return problem or (_walk({"": tag}, path, bounds) if _worth_walking(raw, bounds) else None)


def structured_problem(value: Any, path: str, bounds: Bounds) -> str | None:
    """vLLM's ``structured_outputs``: exactly one constraint, each bounded."""
    if not isinstance(value, dict):
        return f"`{path}` must be an object."
    unknown = next((k for k in value if k not in STRUCTURED_KEYS), None)
    if unknown is not None:
        return f"`{path}.{unknown}` is not a structured-output option."
    given = [k for k in CONSTRAINTS if value.get(k) is not None]
    if len(given) != 1:
        return f"`{path}` must hold exactly one of {', '.join(CONSTRAINTS)}."
    kind, inner = given[0], f"{path}.{given[0]}"
    if value.get("whitespace_pattern") is not None:
        problem = regex_problem(value["whitespace_pattern"], f"{path}.whitespace_pattern", bounds)
        if problem:
            return problem
    return CONSTRAINT_CHECKS[kind](value[kind], inner, bounds)


CONSTRAINT_CHECKS = {
    "json": schema_problem,
    "regex": regex_problem,
    "choice": choice_problem,
    "grammar": grammar_problem,
    "json_object": lambda value, path, _: None,
    "structural_tag": tag_problem,
}


def _format_problem(value: Any, path: str, bounds: Bounds) -> str | None:
    """An OpenAI ``response_format`` (chat, completions), or a ``format`` inside the
    Responses API's ``text`` and the Messages API's ``output_config``."""
    if not isinstance(value, dict):
        return f"`{path}` must be an object."
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return None
    if kind == "json_schema":
        holder = value.get("json_schema", value)  # chat nests it, the others do not
        if not isinstance(holder, dict):
            return f"`{path}.json_schema` must be an object."
        schema = holder.get("schema")
        where = f"{path}.json_schema.schema" if holder is not value else f"{path}.schema"
        return None if schema is None else schema_problem(schema, where, bounds)
    if kind == "structural_tag":
        return tag_problem(value, path, bounds)
    return f"`{path}.type` must be text, json_object, json_schema or structural_tag."


def _nested_format(key: str) -> Any:
    def check(value: Any, path: str, bounds: Bounds) -> str | None:
        if not isinstance(value, dict):
            return f"`{path}` must be an object."
        inner = value.get(key)
        return None if inner is None else _format_problem(inner, f"{path}.{key}", bounds)

    return check


def tools_problem(value: Any, path: str, bounds: Bounds, responses: bool = False) -> str | None:
    """A request's tools: how many, of which kind, and each one's schema bounded. The tools
    are measured together first; one by one only where that could find something."""
    if not isinstance(value, list):
        return f"`{path}` must be a list of tools."
    if len(value) > bounds.tools:
        return f"`{path}` may hold at most {bounds.tools} tools on this appliance."
    problem, raw = _too_big(value, path, bounds.schema_bytes * TOOLS_SCHEMA_SHARE)
    if problem:
        return problem
    each = len(raw) > bounds.schema_bytes or _worth_walking(raw, bounds)
    for index, tool in enumerate(value):
        if not isinstance(tool, dict):
            return f"`{path}[{index}]` must be an object."
        kind = tool.get("type", "function")
        if responses and kind != "function":
            return (
                f"`{path}[{index}]` is a `{kind}` tool: only function tools are accepted on "
                "this appliance (the engines call no servers of their own)."
            )
        schema, where = _tool_schema(tool)
        if schema is not None and (each or not isinstance(schema, dict)):
            problem = schema_problem(schema, f"{path}[{index}].{where}", bounds)
            if problem:
                return problem
    return None


def _tool_schema(tool: dict) -> tuple[Any, str]:
    """A tool's schema and where it is: OpenAI chat's, the Responses API's or Anthropic's."""
    function = tool.get("function")
    if isinstance(function, dict):
        return function.get("parameters"), "function.parameters"
    if "input_schema" in tool:
        return tool["input_schema"], "input_schema"
    return tool.get("parameters"), "parameters"


def _structure(check_value: Any) -> Any:
    """A structured-output check as a field check (its message, as a 400)."""

    def check(name: str, value: Any, rule: Rule, model: ModelInfo, bounds: Bounds) -> Any:
        problem = check_value(value, name, bounds)
        return None if problem is None else refuse(problem, name)

    return check


def _tools_for(responses: bool) -> Any:
    def check(name: str, value: Any, rule: Rule, model: ModelInfo, bounds: Bounds) -> Any:
        problem = tools_problem(value, name, bounds, responses)
        return None if problem is None else refuse(problem, name)

    return check


def _thinking(name: str, value: Any, rule: Rule, model: ModelInfo, bounds: Bounds) -> Any:
    if not isinstance(value, dict):
        return refuse(f"`{name}` must be an object.", name)
    budget = value.get("budget_tokens")
    if budget is None:
        return None
    return _whole(f"{name}.budget_tokens", budget, Rule("whole", 1, "context"), model, bounds)


CHECKS = {
    "whole": _whole,
    "items": _items,
    "logit_bias": _logit_bias,
    "refused": _refused,
    "guarded": _guarded,
    "template_kwargs": _template_kwargs,
    "schema": _structure(schema_problem),
    "regex": _structure(regex_problem),
    "grammar": _structure(grammar_problem),
    "choice": _structure(choice_problem),
    "structured": _structure(structured_problem),
    "response_format": _structure(_format_problem),
    "text": _structure(_nested_format("format")),
    "output_config": _structure(_nested_format("format")),
    "tools": _tools_for(False),
    "function_tools": _tools_for(True),
    "thinking": _thinking,
}


DROP = object()  # marks a field removed before forwarding


# Per API: field -> (its check, or None when it passes as given; its rule).
COMPILED = {
    api: {
        name: (
            None
            if rule.kind in ("forward", "tollgate")
            else DROP
            if rule.kind == "dropped"
            else CHECKS[rule.kind],
            rule,
        )
        for name, rule in rules.items()
    }
    for api, rules in POLICY.items()
}


# --- The engine's own paths ---------------------------------------------------------------


def canonical_path(path: str) -> str:
    """A path as a lenient server might resolve it: case folded, slashes collapsed, dot
    segments resolved, no trailing slash."""
    collapsed = re.sub(r"/{2,}", "/", path.lower())
    return posixpath.normpath(collapsed) if collapsed else "/"


def engine_path(path: str) -> bool:
    """Whether a path names one of the engine's own routes (or, disguised, a /v1 one)."""
    if path in ENGINE_PATHS or path.startswith(ENGINE_PREFIXES):
        return True
    canonical = canonical_path(path)
    if canonical == path:
        return False
    return (
        canonical in ENGINE_PATHS
        or canonical.startswith(ENGINE_PREFIXES)
        or canonical == "/v1"
        or canonical.startswith("/v1/")
        or canonical == "/metrics"
    )
