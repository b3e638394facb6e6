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


def context_error(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


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
