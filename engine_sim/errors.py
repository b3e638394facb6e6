"""vLLM's error bodies: `{"error": {"message", "type", "param", "code"}}`, code = HTTP status."""

from __future__ import annotations


class ApiError(Exception):
    """An error answer: raised anywhere in a handler, rendered by the router."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    """Body validation failure (vLLM reports the HTTP phrase as the type)."""
    return ApiError(400, message, "Bad Request", param)


def field_error(field: str, kind: str, msg: str, value: object) -> ApiError:
    """One pydantic validation error on a body field, as vLLM 0.32 reports it."""
    return pydantic_error(f"body.{field}", kind, msg, value)


def pydantic_error(loc: str, kind: str, msg: str, value: object) -> ApiError:
    detail = {"type": kind, "loc": loc, "msg": msg, "input": _shown(value)}
    return ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", loc)


def _shown(value: object) -> str:
    """The input as vLLM's error handler quotes it: containers only by their size."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def missing_field(field: str, body: dict) -> ApiError:
    return field_error(field, "missing", "Field required", body)


def validation_error(message: str, param: str, value: object = None) -> ApiError:
    """A check in one of vLLM's request validators (VLLMValidationError): BadRequestError,
    with the parameter (and the value, when it has one) named at the end of the message."""
    said = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
    return ApiError(400, f"{message} ({said})", "BadRequestError", param)


def context_error(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def model_not_found(model: str, served: list[str]) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
        "NotFoundError",
        "model",
    )


def prompt_too_long(limit: int, prompt_tokens: int) -> ApiError:
    """vLLM counts a prompt only up to one token past the context, hence "at least"."""
    n = min(prompt_tokens, limit + 1)
    return validation_error(
        f"This model's maximum context length is {limit} tokens. However, your prompt contains "
        f"at least {n} input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt.",
        "input_tokens",
        n,
    )


def queue_full(limit: int | None) -> ApiError:
    return ApiError(
        503,
        f"The waiting queue is full (max_num_queued_reqs={limit}); try again later.",
        "Service Unavailable",
    )


def engine_dead() -> ApiError:
    return ApiError(
        500,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "InternalServerError",
    )
