"""Post-processing of the OpenAPI schema drf-spectacular generates, so it says what the API
does: problem+json error answers, request bodies that refuse unknown fields, and blank
alternatives a value may match together with another (``anyOf``, not ``oneOf``)."""

from typing import Any

from core.problems import MEDIA_TYPE, PROBLEM_TYPES

WRITES = {"post", "put", "patch", "delete"}
THROTTLED = {"auth_token_create"}

PROBLEM_SCHEMA = {
    "type": "object",
    "description": "An RFC 9457 problem: every error under /api/ has this shape.",
    "properties": {
        "type": {
            "type": "string",
            "description": "What kind of problem; resolves to its description.",
        },
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string", "description": "What went wrong, for a person."},
        "instance": {"type": "string", "description": "The path that was asked for."},
        "errors": {
            "type": "array",
            "description": "One entry per field error (400 and 409).",
            "items": {
                "type": "object",
                "properties": {
                    "field": {
                        "type": "string",
                        "nullable": True,
                        "description": "Dotted path of the field; null for the whole request.",
                    },
                    "message": {"type": "string"},
                },
                "required": ["field", "message"],
            },
        },
    },
    "required": ["type", "title", "status", "detail", "instance"],
}


def postprocess(result: dict[str, Any], generator: Any, request: Any, public: bool) -> Any:
    """The drf-spectacular POSTPROCESSING_HOOK (after its enum hook)."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = PROBLEM_SCHEMA
    for name, component in schemas.items():
        _blank_alternatives_any_of(component)
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method in WRITES | {"get"}:
                _declare_problems(method, operation)
    return result


def _blank_alternatives_any_of(node: Any) -> None:
    """``""`` matches both a pattern and the blank branch: ``oneOf`` would refuse it."""
    if isinstance(node, dict):
        alternatives = node.get("oneOf")
        if isinstance(alternatives, list) and any(_is_blank(a) for a in alternatives):
            node["anyOf"] = node.pop("oneOf")
        for value in node.values():
            _blank_alternatives_any_of(value)
    elif isinstance(node, list):
        for value in node:
            _blank_alternatives_any_of(value)


def _is_blank(schema: Any) -> bool:
    return isinstance(schema, dict) and (
        schema.get("$ref", "").endswith("/BlankEnum") or schema.get("maxLength") == 0
    )


def _declare_problems(method: str, operation: dict[str, Any]) -> None:
    # 401/403 also on the token exchange: a wrong password, a one-time password.
    codes = [400, 401, 403, 404]
    if method in WRITES:
        codes += [409, 415]
    if operation.get("operationId") in THROTTLED:
        codes.append(429)
    responses = operation.setdefault("responses", {})
    by_status = {p.status: p for p in reversed(PROBLEM_TYPES.values())}
    for code in sorted(codes):
        responses.setdefault(
            str(code),
            {
                "description": by_status[code].title,
                "content": {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
            },
        )
