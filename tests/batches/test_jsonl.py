"""Batch input files are checked line by line; the first bad line is named."""

import orjson
import pytest

from batches.jsonl import InvalidFile, parse_requests


def line(custom_id: str = "r1", **overrides: object) -> dict:
    item = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "sim-chat", "messages": [{"role": "user", "content": "hi"}]},
    }
    return {**item, **overrides}


def jsonl(*items: object) -> bytes:
    return b"".join((i if isinstance(i, bytes) else orjson.dumps(i)) + b"\n" for i in items)


def test_valid_file_gives_each_request_with_its_line_number() -> None:
    requests = parse_requests(jsonl(line("a"), b"", line("b", url="/v1/completions")), max_lines=10)
    assert [(r.line, r.custom_id, r.url) for r in requests] == [
        (1, "a", "/v1/chat/completions"),
        (3, "b", "/v1/completions"),
    ]
    assert requests[0].body["model"] == "sim-chat"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b"{not json", "Line 2: This line is not valid JSON."),
        (b"[1, 2]", "Line 2: Each line must be a JSON object."),
        (line("x", method="GET"), 'Line 2: method must be "POST".'),
        (line("x", url="/v1/images/generations"), "Line 2: url must be one of"),
        (line("x", body="hi"), "Line 2: body must be a JSON object."),
        (line("x", body={"messages": []}), "Line 2: body.model must be a non-empty string."),
        (line("x", body={"model": "m", "stream": True}), "Line 2: body.stream is not supported"),
        (line(""), "Line 2: custom_id must be a non-empty string"),
        (line("r1"), "Line 2: custom_id 'r1' is already used on line 1"),
    ],
)
def test_the_first_bad_line_is_named(bad: object, message: str) -> None:
    with pytest.raises(InvalidFile) as caught:
        parse_requests(jsonl(line("r1"), bad, b"{also bad"), max_lines=10)
    assert str(caught.value).startswith(message)
    assert caught.value.line == 2


def test_empty_oversized_and_non_utf8_files_are_refused() -> None:
    with pytest.raises(InvalidFile, match="no requests"):
        parse_requests(b"\n\n", max_lines=10)
    with pytest.raises(InvalidFile, match="Line 3: The file has more than 2 requests"):
        parse_requests(jsonl(line("a"), line("b"), line("c")), max_lines=2)
    with pytest.raises(InvalidFile, match="not UTF-8"):
        parse_requests(b"\xff\xfe" + jsonl(line()), max_lines=10)
