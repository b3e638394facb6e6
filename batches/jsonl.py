"""Checks an uploaded batch input file line by line (pure: bytes in, requests or an error out)."""

from dataclasses import dataclass
from typing import Any

import orjson

from batches.choices import ENDPOINTS

MAX_CUSTOM_ID = 512


class InvalidFile(ValueError):
    """The file is not a valid batch input; ``line`` is 1-based (None: the whole file)."""

    def __init__(
        self, message: str, line: int | None = None, code: str = "invalid_batch_file"
    ) -> None:
        self.line = line
        self.code = code
        super().__init__(f"Line {line}: {message}" if line else message)


@dataclass(frozen=True)
class Request:
    """One request of a batch input file."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_requests(data: bytes, max_lines: int) -> list[Request]:
    """Every request of a JSONL batch file, or InvalidFile naming the first bad line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidFile("The file is not UTF-8 text.", code="invalid_encoding") from None
    requests: list[Request] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline, say) carry no request
        if len(requests) == max_lines:
            raise InvalidFile(
                f"The file has more than {max_lines} requests.", number, "too_many_lines"
            )
        request = parse_line(raw, number)
        if request.custom_id in seen:
            raise InvalidFile(
                f"custom_id {request.custom_id!r} is already used on line "
                f"{seen[request.custom_id]}; "
                "each custom_id must be unique.",
                number,
                "duplicate_custom_id",
            )
        seen[request.custom_id] = number
        requests.append(request)
    if not requests:
        raise InvalidFile("The file has no requests.", code="empty_file")
    return requests


def parse_line(raw: str, number: int) -> Request:
    """One line: ``{"custom_id", "method": "POST", "url", "body": {...}}``."""
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidFile("This line is not valid JSON.", number, "invalid_json_line") from None
    if not isinstance(item, dict):
        raise InvalidFile("Each line must be a JSON object.", number)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise InvalidFile(
            f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters.", number
        )
    if item.get("method") != "POST":
        raise InvalidFile('method must be "POST".', number)
    if item.get("url") not in ENDPOINTS:
        raise InvalidFile(f"url must be one of {', '.join(ENDPOINTS)}.", number)
    body = item.get("body")
    if not isinstance(body, dict):
        raise InvalidFile("body must be a JSON object.", number)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidFile("body.model must be a non-empty string.", number)
    if body.get("stream") is True:
        raise InvalidFile("body.stream is not supported in a batch; leave it out.", number)
    return Request(line=number, custom_id=custom_id, url=item["url"], body=body)
