"""Error bodies in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

(The 401 for a bad key is ``core.credentials.INVALID_KEY``: every /v1 door answers with it.)"""

import orjson


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def model_not_found(model: str) -> bytes:
    # Identical for a model that does not exist and one the tenant may not use.
    return error_body(
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def normalise_upstream_error(status: int, raw: bytes) -> bytes:
    """An engine's error (vLLM nests it and uses numeric codes) in OpenAI's shape."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or "The engine refused the request.")
        param = error.get("param")
    elif isinstance(parsed, dict) and ("message" in parsed or "detail" in parsed):
        message, param = str(parsed.get("message") or parsed.get("detail")), parsed.get("param")
    else:
        message, param = "The engine failed to answer the request.", None
    code = "context_length_exceeded" if "maximum context length" in message else None
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return error_body(message, type_, param if isinstance(param, str) else None, code)
