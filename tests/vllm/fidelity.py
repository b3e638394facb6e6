"""Runs one fidelity scenario against an engine and compares what two engines answered.

``observe(scenario, url)`` sends the scenario's request and turns the answer into a plain
document: ``{"status": …, "body": …}`` for JSON, the collapsed event sequence plus the first
frame of each event kind for SSE, label sets for /metrics, outcomes for the abort and
accounting scenarios, what happened for the LoRA exchanges (an adapter's requests waiting
for the slot, unloaded mid-stream, more adapters than the engine keeps read).
``differences(real, sim, scenario)`` lists every place where the simulator's document
differs from the real vLLM's, each with its exact path.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.vllm.fidelity_scenarios import CACHE_CONFIG_LABELS, METRIC_FAMILIES, MODEL, Scenario

TIMEOUT = 120.0
ABORT_DEADLINE = 60.0


def shape_differences(
    real: Any, sim: Any, path: str = "", skip: frozenset = frozenset()
) -> list[str]:
    """Missing keys, extra keys and type mismatches between two JSON values, by path.
    Lists are compared element by element (lengths are a value, see ``differences``)."""
    if path in skip:
        return []
    if type(real) is not type(sim):
        return [
            f"{path or '<root>'}: type {type(sim).__name__} in sim, {type(real).__name__} in vLLM"
        ]
    if isinstance(real, dict):
        out = [f"{_join(path, k)}: missing in sim" for k in real if k not in sim]
        out += [f"{_join(path, k)}: extra in sim" for k in sim if k not in real]
        out = [line for line in out if line.partition(":")[0] not in skip]
        for key in real.keys() & sim.keys():
            out += shape_differences(real[key], sim[key], _join(path, key), skip)
        return out
    if isinstance(real, list):
        out = []
        for i, (a, b) in enumerate(zip(real, sim, strict=False)):
            out += shape_differences(a, b, f"{path}[{i}]", skip)
        if bool(real) != bool(sim):
            out.append(f"{path}: {len(sim)} items in sim, {len(real)} in vLLM")
        return out
    return []


def _join(path: str, key: str) -> str:
    """``a.b``, or ``a[b.c]`` for a key with a dot in it (Responses' event names)."""
    if "." in key:
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def pick(doc: Any, path: str) -> Any:
    """The value at ``a.b[0].c`` in ``doc``; KeyError/IndexError when it is not there."""
    for part in re.findall(r"[^.\[\]]+|\[[^\]]+\]", path):
        if part.startswith("["):
            part = part[1:-1]
            doc = doc[int(part)] if part.isdigit() else doc[part]
        else:
            doc = doc[part]
    return doc


def masked(value: Any) -> Any:
    """The value with every run of digits replaced: messages that quote token counts."""
    return re.sub(r"\d+", "#", value) if isinstance(value, str) else value


def differences(real: dict, sim: dict, scenario: Scenario) -> list[str]:
    """Every difference the scenario does not declare deliberate, one line each."""
    skip = frozenset(scenario.deliberate_shape)
    out = shape_differences(real, sim, skip=skip)
    for path in scenario.same:
        out += _value_difference(real, sim, path, lambda v: v)
    for path in scenario.same_masked:
        out += _value_difference(real, sim, path, masked)
    for path, want in scenario.expect.items():
        out += _expected(real, path, want)
    return out


def _expected(real: dict, path: str, want: Any) -> list[str]:
    try:
        got = pick(real, path)
    except (KeyError, IndexError, TypeError):
        got = "nothing"
    if got == want:
        return []
    return [f"{path}: vLLM itself has {got!r}, not {want!r}: the scenario proved nothing"]


def _value_difference(real: dict, sim: dict, path: str, norm: Callable[[Any], Any]) -> list[str]:
    try:
        want = norm(pick(real, path))
    except (KeyError, IndexError, TypeError):
        return [f"{path}: not in vLLM's answer (the scenario compares it)"]
    try:
        got = norm(pick(sim, path))
    except (KeyError, IndexError, TypeError):
        return [f"{path}: missing in sim (vLLM has {want!r})"]
    return [] if got == want else [f"{path}: sim has {got!r}, vLLM has {want!r}"]


# --- observing one engine ---------------------------------------------------------------


def observe(scenario: Scenario, url: str) -> dict:
    """The scenario's outcome on the engine at ``url``, as a comparable document."""
    prepare(scenario, url)
    return OBSERVERS[scenario.kind](scenario, url)


def prepare(scenario: Scenario, url: str) -> None:
    for path, body in scenario.before:
        httpx.post(url + path, json=body, timeout=TIMEOUT)


def _json(scenario: Scenario, url: str) -> dict:
    r = httpx.request(scenario.method, url + scenario.path, json=scenario.body, timeout=TIMEOUT)
    return {"status": r.status_code, "content_type": _ctype(r), "body": _body(r)}


def _body(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _ctype(r: httpx.Response) -> str:
    return r.headers.get("content-type", "").split(";")[0]


def _sse(scenario: Scenario, url: str) -> dict:
    r = httpx.post(url + scenario.path, json=scenario.body, timeout=TIMEOUT)
    frames = list(_frames(r.text))
    kinds = [_kind(scenario.path, event, data) for event, data in frames]
    first: dict[str, Any] = {}
    for kind, (_, data) in zip(kinds, frames, strict=True):
        first.setdefault(kind, data)
    return {
        "status": r.status_code,
        "content_type": _ctype(r),
        "sequence": _collapse(kinds),
        "frames": first,
    }


def _frames(text: str) -> Iterator[tuple[str | None, Any]]:
    """(event name or None, parsed data) per SSE frame; keep-alive comments dropped."""
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        fields = dict(
            line.split(": ", 1) if ": " in line else (line.rstrip(":"), "")
            for line in frame.split("\n")
            if line and not line.startswith(":")
        )
        if "data" in fields:
            data = fields["data"]
            yield fields.get("event"), data if data == "[DONE]" else json.loads(data)


def _kind(path: str, event: str | None, data: Any) -> str:
    """What a frame is, independent of its text: the event name where the API names its
    events, else what an OpenAI chunk carries (role, content, finish, usage)."""
    if event is not None:
        return event
    if data == "[DONE]" or "error" in data:
        return "[DONE]" if data == "[DONE]" else "error"
    if not data.get("choices"):
        return "usage"
    choice = data["choices"][0]
    carried = sorted(k for k, v in choice.get("delta", choice).items() if v not in (None, ""))
    parts = [p for p in carried if p not in ("index", "logprobs", "finish_reason")]
    finish = "+finish" if choice.get("finish_reason") else ""
    if not parts and (not finish or choice["finish_reason"] == "length"):
        # vLLM sends an empty delta for a token whose bytes end mid-character: still a token.
        parts = ["content" if "chat" in path else "text"]
    return ("+".join(parts) or "empty") + finish


def _collapse(kinds: list[str]) -> list[str]:
    """Runs of the same kind as one entry: token counts differ, the sequence does not."""
    out: list[str] = []
    for kind in kinds:
        if not out or out[-1].removesuffix("*") != kind:
            out.append(kind)
        elif not out[-1].endswith("*"):
            out[-1] += "*"
    return [k.removesuffix("*") for k in out]


def _metrics(scenario: Scenario, url: str) -> dict:
    """Per family Tollgate reads: its sample names with their label names."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    families: dict[str, dict[str, list[str]]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if line.startswith("#") or name not in METRIC_FAMILIES:
            continue
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', rest.partition("}")[0]))
        if name == "vllm:cache_config_info":
            pairs = {k: v for k, v in pairs.items() if k in CACHE_CONFIG_LABELS}
            families[name] = {"block_size": pairs.get("block_size")}
        if name == "vllm:lora_requests_info":
            families[name] = {"max_lora": pairs.get("max_lora")}
        families.setdefault(name, {})["labels"] = sorted(pairs)
    return {"families": families}


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of one metric's samples whose labels contain ``label``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.partition("{")[0].partition(" ")[0] == name and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _abort(scenario: Scenario, url: str) -> dict:
    """Send the request on a raw socket, hang up once the engine runs it (streaming: once
    the first token arrived), then wait until the engine's running count is back to 0.

    On two cores the CPU engine sometimes holds a stream's frames back and sends them in
    one burst at the end: then the reply was over before the hang-up could reach it, and
    the run says nothing. Such a run is made again (up to three times in all)."""
    for _ in range(3):
        outcome = _abort_once(scenario, url)
        if outcome["generated_fewer_than_asked"]:
            break
    return outcome


def _abort_once(scenario: Scenario, url: str) -> dict:
    asked = scenario.body["max_tokens"]
    before = metric(url, "vllm:generation_tokens_total")
    aborts = metric(url, "vllm:request_success_total", 'finished_reason="abort"')
    with _raw_request(url, scenario.path, scenario.body) as sock:
        if scenario.body.get("stream"):
            _read_until(sock, b"data: {", ABORT_DEADLINE)
        else:
            # /load counts the request from the moment its handler runs, and answers in
            # microseconds: /metrics on a busy machine can take longer than the whole reply.
            wait_for(lambda: _server_load(url) >= 1, ABORT_DEADLINE, "the request to arrive")
    wait_for(lambda: metric(url, "vllm:num_requests_running") == 0, ABORT_DEADLINE, "abort")
    generated = metric(url, "vllm:generation_tokens_total") - before
    return {
        "running_after": metric(url, "vllm:num_requests_running"),
        "load_after": _server_load(url),
        "generated_fewer_than_asked": generated < asked,
        "abort_counted": metric(url, "vllm:request_success_total", 'finished_reason="abort"')
        - aborts,
    }


def _server_load(url: str) -> int:
    return httpx.get(url + "/load", timeout=TIMEOUT).json()["server_load"]


class _raw_request:
    """An HTTP/1.1 POST on a plain socket, closed (the client leaves) on exit."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        self.addr = urlsplit(url)
        self.payload = json.dumps(body).encode()
        self.path = path

    def __enter__(self) -> socket.socket:
        self.sock = socket.create_connection((self.addr.hostname, self.addr.port), timeout=30)
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.addr.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(self.payload)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + self.payload)
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def _read_until(sock: socket.socket, marker: bytes, timeout: float) -> None:
    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen:
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout:.0f} s"
        chunk = sock.recv(4096)
        assert chunk, f"the engine closed the stream before {marker!r}: {seen[-300:]!r}"
        seen += chunk


def _accounting(scenario: Scenario, url: str) -> dict:
    """The same fresh prompt twice: the counters move by exactly the usage reported, the
    second request's cached tokens are the prefix cache hits /metrics counts, and what the
    first wrote to the cache (where the API reports it) is what the second reads."""
    out: dict = {}
    body = _fresh(scenario.body)
    for attempt in ("first", "second"):
        before = {name: metric(url, name) for name in ACCOUNTED}
        r = httpx.post(url + scenario.path, json=body, timeout=TIMEOUT)
        prompt, generated, cached, written = _usage_numbers(r.json()["usage"])
        moved = {name: metric(url, name) - before[name] for name in ACCOUNTED}
        out[attempt] = {
            "status": r.status_code,
            "prompt_tokens_counted": moved["vllm:prompt_tokens_total"] == prompt,
            "generation_counted": moved["vllm:generation_tokens_total"] == generated,
            "hits_are_cached_tokens": moved["vllm:prefix_cache_hits_total"] == cached,
            "some_cached": bool(cached),
            "some_written": bool(written),
        }
        out[f"{attempt}_tokens"] = (cached, written)
    first_written, second_cached = out.pop("first_tokens")[1], out.pop("second_tokens")[0]
    out["second_reads_what_first_wrote"] = first_written in (None, second_cached)
    return out


def _usage_numbers(usage: dict) -> tuple[int, int, int | None, int | None]:
    """(prompt tokens, generated tokens, cached prompt tokens, prompt tokens written to the
    cache) from any API's usage: OpenAI's, Responses' (input/output tokens) or Anthropic's
    (input_tokens net of cache reads and writes)."""
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        cached, written = details.get("cached_tokens"), details.get("created_cache_tokens")
        return usage["prompt_tokens"], usage["completion_tokens"], cached, written
    if "input_tokens_details" in usage:
        details = usage["input_tokens_details"]
        cached, written = details["cached_tokens"], details.get("cache_write_tokens")
        return usage["input_tokens"], usage["output_tokens"], cached, written
    cached = usage.get("cache_read_input_tokens")
    written = usage.get("cache_creation_input_tokens")
    prompt = usage["input_tokens"] + (cached or 0) + (written or 0)
    return prompt, usage["output_tokens"], cached, written


def _fresh(body: dict) -> dict:
    """The body with a prompt no earlier request began with: the first send is a miss."""
    if "input" in body:
        return {**body, "input": f"{uuid.uuid4().hex} {body['input']}"}
    first = body["messages"][0]
    fresh = {**first, "content": f"{uuid.uuid4().hex} {first['content']}"}
    return {**body, "messages": [fresh, *body["messages"][1:]]}


ACCOUNTED = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_hits_total",
)

# --- LoRA exchanges (tests/vllm/lora_scenarios.py) --------------------------------------


class _Background:
    """A request sent on a thread (a stream is read to its end, ``started`` set at its first
    frame); ``result`` holds what it ended with (its frames, or its status and body).
    ``label`` is appended to ``finished`` when the answer is complete."""

    def __init__(
        self, url: str, path: str, body: dict, label: str = "", finished: list | None = None
    ) -> None:
        self.started = threading.Event()
        self.result: dict = {}
        self.label, self.finished = label, finished if finished is not None else []
        self.thread = threading.Thread(target=self._run, args=(url + path, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            if body.get("stream"):
                self.result = self._stream(url, body)
            else:
                r = httpx.post(url, json=body, timeout=TIMEOUT)
                self.result = {"status": r.status_code, "body": _body(r)}
        finally:
            self.finished.append(self.label)
            self.started.set()

    def _stream(self, url: str, body: dict) -> dict:
        frames: list[Any] = []
        with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    frames.append(data if data == "[DONE]" else json.loads(data))
                    self.started.set()
        return {"status": r.status_code, "frames": frames}

    def join(self) -> dict:
        self.thread.join(TIMEOUT)
        return self.result


def _ending(result: dict, asked: int) -> dict:
    """How a chat request sent by _Background ended: its status and finish, whether it got
    every token asked for (usage), and for a stream an error frame and [DONE]."""
    if "frames" not in result:
        body = result.get("body")
        body = body if isinstance(body, dict) and "choices" in body else {}
        return {
            "status": result.get("status"),
            "finish_reason": body.get("choices", [{}])[0].get("finish_reason"),
            "every_token": body.get("usage", {}).get("completion_tokens") == asked,
        }
    chunks = [f for f in result["frames"] if isinstance(f, dict)]
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), {})
    return {
        "status": result.get("status"),
        "finish_reason": next((f for f in reversed(finishes) if f), None),
        "every_token": usage.get("completion_tokens") == asked,
        "error_frame": any("error" in c for c in chunks),
        "done": result["frames"][-1:] == ["[DONE]"],
    }


def _short(scenario: Scenario, model: str) -> dict:
    """A six-token chat on ``model`` (the long request's prompt)."""
    messages = scenario.body["messages"]
    return {"model": model, "messages": messages, "max_tokens": 6, "ignore_eos": True}


def _lora_slot(scenario: Scenario, url: str) -> dict:
    """Two long streams on two adapters and a shorter request on the base, sent at once to
    an engine with one adapter slot (--max-loras 1). What happened is read from the engine
    afterwards, not while it decodes (the CPU engine's API server may then not answer for
    seconds on a busy machine): which answer ended first, how many requests waited over a
    0.3 s to be scheduled, which lists of adapters vllm:lora_requests_info stamped. Made
    again (up to three times in all) when the requests did not meet in the engine as the
    scenario means them to (each engine's observation is made so, then compared)."""
    met = {k: v for k, v in scenario.expect.items() if k in ("finished_first", "lora_info_stamped")}
    for _ in range(3):
        outcome = _lora_slot_once(scenario, url)
        if all(outcome[k] == v for k, v in met.items()):
            break
    return outcome


# A request kept waiting for the one LoRA slot waits as long as the other adapter's stream
# (1,900 tokens): about a second on a quiet two-core machine, several on a busy one. Counted
# from vLLM's queue-time histogram's 0.3-s bucket (the simulator's has the same buckets).
WAIT_BOUND = "0.3"


def _lora_slot_once(scenario: Scenario, url: str) -> dict:
    stamps, waited = _lora_stamps(url), _waited_over(url, WAIT_BOUND)
    finished: list[str] = []
    adapters = (scenario.body["model"], scenario.params["other"])
    sent = [
        _Background(url, scenario.path, {**scenario.body, "model": name}, name, finished)
        for name in adapters
    ]
    base_body = {**_short(scenario, MODEL), "max_tokens": scenario.params["beside"]}
    sent.append(_Background(url, scenario.path, base_body, "base", finished))
    asked = (scenario.body["max_tokens"],) * 2 + (scenario.params["beside"],)
    endings = [_ending(r.join(), n) for r, n in zip(sent, asked, strict=True)]
    # The engine stamps "nothing running" at its next stats pass after the last answer: on a
    # busy machine a moment after the clients saw it end.
    deadline = time.monotonic() + 15
    now = _lora_stamps(url)
    while now.get("") == stamps.get("") and time.monotonic() < deadline:
        time.sleep(0.2)
        now = _lora_stamps(url)
    return {
        "finished_first": finished[0] if finished else None,
        "waited_for_the_slot": _waited_over(url, WAIT_BOUND) - waited,
        "lora_info_stamped": sorted(k for k, v in now.items() if stamps.get(k) != v),
        "endings": endings,
    }


def _lora_stamps(url: str) -> dict[str, float]:
    """vllm:lora_requests_info: its running_lora_adapters label -> the time it was current."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith("vllm:lora_requests_info{"):
            adapters = re.search(r'running_lora_adapters="([^"]*)"', line).group(1)
            out[adapters] = float(line.rsplit(" ", 1)[1])
    return out


def _waited_over(url: str, bound: str) -> float:
    """Requests that waited longer than ``bound`` seconds in the queue, so far."""
    name = "vllm:request_queue_time_seconds"
    return metric(url, name + "_count") - metric(url, name + "_bucket", f'le="{bound}"')


def _same_files(scenario: Scenario, url: str) -> dict:
    """More adapters than --max-cpu-loras, two of them the same files under two names: each
    asked twice, in turn (every request on an adapter the worker let go reads it again)."""
    names = scenario.params["adapters"]
    answers: dict[str, list] = {name: [] for name in names}
    for _ in range(2):
        for name in names:
            body = {**scenario.body, "model": name}
            r = httpx.post(url + scenario.path, json=body, timeout=TIMEOUT)
            ok = r.status_code == 200
            answers[name].append(r.json()["choices"][0]["message"]["content"] if ok else None)
    twins = scenario.params["twins"]
    return {
        "all_answered": all(None not in got for got in answers.values()),
        "each_answers_the_same_again": all(a == b for a, b in answers.values()),
        "twins_answer_alike": all(answers[x] == answers[y] for x, y in twins),
        "others_differ": len({got[0] for got in answers.values()}) == len(names) - len(twins),
    }


OBSERVERS: dict[str, Callable[[Scenario, str], dict]] = {
    "json": _json,
    "sse": _sse,
    "metrics": _metrics,
    "abort": _abort,
    "accounting": _accounting,
    "lora_slot": _lora_slot,
    "same_files": _same_files,
}
