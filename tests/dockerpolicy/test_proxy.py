"""The policy process's behaviour on the wire, in front of a fake Docker Engine (harness.py):
what reaches Docker, what streams, what is refused and what is logged.

Every call Tollgate's runtime makes (deployments/runtime.py, through the real Docker SDK)
is made here and must pass; the docker stage repeats this against a real Engine.
"""

import http.client
import io
import json
import logging
import re
import tarfile
from collections.abc import Iterator

import httpx
import pytest

from deployments import runtime
from dockerpolicy.settings import Settings
from tests.dockerpolicy.harness import Harness

STACK = "tgunit"
IMAGE = "tollgate/engine-sim:latest"


def policy_settings(**more: object) -> Settings:
    values = dict(
        images=("tollgate/engine-sim:*", "vllm/vllm-openai:*"),
        volumes=frozenset({f"{STACK}-models", f"{STACK}-compile"}),
        networks=frozenset({f"{STACK}-net"}),
        stack=STACK,
        allow_host_network=False,
        log_allowed=True,
    )
    return Settings(**{**values, **more})


@pytest.fixture
def harness(settings: object) -> Iterator[Harness]:
    settings.TOLLGATE_STACK_ID = STACK
    settings.TOLLGATE_MODEL_CACHE_VOLUME = f"{STACK}-models"
    settings.TOLLGATE_COMPILE_CACHE_VOLUME = f"{STACK}-compile"
    settings.TOLLGATE_ENGINE_NETWORK = f"{STACK}-net"
    h = Harness(policy_settings())
    h.start()
    yield h
    h.stop()


def raw(
    h: Harness,
    method: str,
    target: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dockerpolicy" and r.getMessage().startswith("refused")
    ]


def engine(name: str, **more: object) -> runtime.EngineSpec:
    fields = dict(
        name=name,
        image=IMAGE,
        command=["m", "--port", "8000"],
        env={"HF_TOKEN": "hf_secret"},
        labels=runtime.labels_for(STACK, "n1", 1, 0),
        gpus=True,
        engine_host="127.0.0.1",
    )
    return runtime.engine_spec(**{**fields, **more})


def test_every_call_of_the_engine_lifecycle_passes(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dockerpolicy")
    dc = runtime.client(harness.url)
    assert runtime.info(dc)["ServerVersion"] == "20.10.24"
    assert runtime.image_present(dc, IMAGE)
    for n in range(3):
        harness.release(f"pull-{n}")
    assert len(list(runtime.pull(dc, IMAGE))) == 3
    runtime.ensure_network(dc, f"{STACK}-net")

    published = runtime.create_engine(dc, engine(f"{STACK}-a-0"))  # GPUs, port on loopback
    joined = runtime.create_engine(dc, engine(f"{STACK}-a-1", engine_host=""))  # engine network
    runtime.start(published)
    assert runtime.refresh(published).status == "running"
    assert runtime.logs_tail(published, 20) == "line one\nline two\n"
    assert runtime.find(dc, f"{STACK}-a-1").id == joined.id
    assert {c.id for c in runtime.list_managed(dc, STACK, "n1")} == {published.id, joined.id}
    helper = runtime.run_to_completion(
        dc,
        IMAGE,
        ["hf", "download"],
        ["Qwen/Qwen3-0.6B"],
        {"HF_TOKEN": "hf_secret"},
        runtime.labels_for(STACK, "n1", role="stage"),
        f"{STACK}-stage-1",
    )
    for container in (published, joined, helper):
        runtime.stop_and_remove(container, 3)
    assert harness.docker.containers == {}
    assert refusals(caplog) == []
    assert {template(r.method, r.target) for r in harness.docker.received} == {
        "GET /version",
        "GET /info",
        "GET /images/{ref}/json",
        "POST /images/create",
        "GET /networks",
        "POST /networks/create",
        "GET /networks/{id}",
        "POST /containers/create",
        "GET /containers/{id}/json",
        "POST /containers/{id}/start",
        "GET /containers/{id}/logs",
        "GET /containers/json",
        "POST /containers/{id}/stop",
        "DELETE /containers/{id}",
    }
    assert "hf_secret" not in caplog.text


def template(method: str, target: str) -> str:
    path = re.sub(r"^/v1\.[0-9]+", "", target.split("?")[0])
    path = re.sub(r"^/images/.+/json$", "/images/{ref}/json", path)
    path = re.sub(r"^/(containers|networks)/(?!json$|create$)[^/]+", r"/\1/{id}", path)
    return f"{method} {path}"


def test_docker_receives_the_canonical_body_and_none_of_the_client_s_headers(
    harness: Harness,
) -> None:
    body = (
        (
            '{"image" : "IMAGE",'
            ' "LABELS": {"tollgate.managed": "true", "tollgate.stack": "STACK"},\n'
            ' "hostconfig": {"networkmode": "default", "Bind\u017f": ["STACK-models:/m:ro"]},'
            ' "volumes": {"/m": {}}, "Unknown": {"Privileged": true}, "env": ["A=\\u0042"]}'
        )
        .replace("IMAGE", IMAGE)
        .replace("STACK", STACK)
        .encode()
    )
    status, _, _ = raw(
        harness,
        "POST",
        f"/v1.41/containers/create?name={STACK}-x",
        body,
        {
            "Content-Type": "application/json; charset=utf-8",
            "X-Meta-Evil": "1",
            "Cookie": "a=b",
            "X-Registry-Auth": "e30=",
            "Authorization": "Bearer x",
        },
    )
    assert status == 201
    (received,) = harness.docker.received
    assert received.target == f"/v1.41/containers/create?name={STACK}-x"
    assert received.body == (
        b'{"Env":["A=B"],"HostConfig":{"Binds":["tgunit-models:/m:ro"],"NetworkMode":"default"},'
        b'"Image":"tollgate/engine-sim:latest","Labels":{"tollgate.managed":"true",'
        b'"tollgate.stack":"tgunit"},"Volumes":{"/m":{}}}'
    )
    assert received.headers["content-type"] == "application/json"
    assert not {"x-meta-evil", "cookie", "x-registry-auth", "authorization", "user-agent"} & set(
        received.headers
    )


def test_a_refusal_is_a_docker_style_403_with_one_log_line_and_reaches_nothing(
    harness: Harness,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "dockerpolicy")
    body = json.dumps(
        {"Image": IMAGE, "Env": ["HF_TOKEN=hf_topsecret"], "HostConfig": {"Privileged": True}}
    ).encode()
    status, headers, answer = raw(
        harness,
        "POST",
        f"/v1.41/containers/create?name={STACK}-x",
        body,
        {"Content-Type": "application/json", "User-Agent": "evil\r\n"[:4]},
    )
    assert (status, headers["content-type"].split(";")[0]) == (403, "application/json")
    assert json.loads(answer) == {
        "message": "refused by Tollgate's Docker policy: HostConfig.Privileged is not allowed"
    }
    assert harness.docker.received == []
    (line,) = refusals(caplog)
    assert line == (
        f"refused POST /v1.41/containers/create?name={STACK}-x from 127.0.0.1 (evil): "
        "HostConfig.Privileged is not allowed"
    )
    assert "hf_topsecret" not in caplog.text


def test_the_sdk_shows_the_policy_s_reason(harness: Harness) -> None:
    dc = runtime.client(harness.url)
    with pytest.raises(
        runtime.RuntimeFailure,
        match="creating container .* refused by Tollgate's "
        "Docker policy: HostConfig.NetworkMode host",
    ):
        runtime.create_engine(dc, engine(f"{STACK}-h", host_network=True))


def test_host_networking_passes_only_when_allowed(settings: object) -> None:
    settings.TOLLGATE_STACK_ID = STACK
    settings.TOLLGATE_MODEL_CACHE_VOLUME = f"{STACK}-models"
    settings.TOLLGATE_COMPILE_CACHE_VOLUME = f"{STACK}-compile"
    h = Harness(policy_settings(allow_host_network=True))
    h.start()
    try:
        container = runtime.create_engine(
            runtime.client(h.url), engine(f"{STACK}-h", host_network=True)
        )
        assert json.loads(h.docker.received[-2].body)["HostConfig"]["NetworkMode"] == "host"
        assert container.id in h.docker.containers
    finally:
        h.stop()


def test_calls_on_a_container_act_on_its_full_id_after_its_labels_are_checked(
    harness: Harness,
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = harness.docker.add_container(
        f"{STACK}-own", {"tollgate.managed": "true", "tollgate.stack": STACK}
    )
    foreign = harness.docker.add_container("db", {})
    other = harness.docker.add_container(
        "other-x", {"tollgate.managed": "true", "tollgate.stack": "other"}
    )

    assert raw(harness, "POST", f"/v1.41/containers/{STACK}-own/start")[0] == 204
    assert [r.target for r in harness.docker.received] == [
        f"/v1.41/containers/{STACK}-own/json",
        f"/v1.41/containers/{own}/start",
    ]
    harness.docker.received.clear()
    for ref in ("db", foreign[:12], "other-x", other):
        for method, path in (
            ("POST", "start"),
            ("POST", "stop"),
            ("POST", "kill"),
            ("POST", "wait"),
            ("GET", "logs"),
            ("GET", "json"),
        ):
            status, _, answer = raw(harness, method, f"/v1.41/containers/{ref}/{path}")
            assert status == 403 and b"is not Tollgate's" in answer, (ref, path)
        assert raw(harness, "DELETE", f"/v1.41/containers/{ref}?force=1")[0] == 403
    assert {r.method for r in harness.docker.received} == {"GET"}  # only the policy's inspects
    assert all(r.target.endswith("/json") for r in harness.docker.received)
    assert len(harness.docker.containers) == 3 and len(refusals(caplog)) == 4 * 7
    status, _, answer = raw(harness, "POST", "/v1.41/containers/nothing/start")
    assert (status, json.loads(answer)) == (404, {"message": "No such container: nothing"})


def adapter_tar(*names: str) -> bytes:
    """A tar as the worker sends it: an uploaded adapter's files under tollgate-adapters/."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size, info.uid = 3, 1000
            tar.addfile(info, io.BytesIO(b"abc"))
    return buffer.getvalue()


GOOD_TAR = ("tollgate-adapters/a-1/adapter_config.json", "tollgate-adapters/a-1/w.safetensors")
PUT_PATH = "archive?path=%2Froot%2F.cache%2Fhuggingface"


def test_an_uploaded_adapter_is_put_into_a_created_helper_s_model_cache(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """runtime.copy_into_cache: a helper created (never started), the tar put, the helper
    removed; Docker receives the tar rebuilt (owner root) at the cache's mount point."""
    dc = runtime.client(harness.url)
    labels = runtime.labels_for(STACK, "n1", role="stage")
    runtime.copy_into_cache(
        dc, IMAGE, labels, f"{STACK}-adapter-copy-1", io.BytesIO(adapter_tar(*GOOD_TAR))
    )
    (put,) = [r for r in harness.docker.received if r.method == "PUT"]
    assert re.fullmatch(
        r"/v1\.[0-9]+/containers/[0-9a-f]{64}/archive"
        r"\?path=%2Froot%2F\.cache%2Fhuggingface&noOverwriteDirNonDir=1",
        put.target,
    )
    assert put.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(put.body)) as tar:
        assert [(m.name, m.uid) for m in tar.getmembers()] == [(n, 0) for n in GOOD_TAR]
    assert "POST /containers/{id}/start" not in {
        template(r.method, r.target) for r in harness.docker.received
    }
    assert harness.docker.containers == {} and refusals(caplog) == []


def test_archives_go_only_into_this_stack_s_fresh_helpers_and_only_tollgate_adapters(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    helper = {"tollgate.managed": "true", "tollgate.stack": STACK, "tollgate.role": "stage"}
    harness.docker.add_container(f"{STACK}-fresh", helper)
    harness.docker.add_container(f"{STACK}-engine", {**helper, "tollgate.role": "engine"})
    started = harness.docker.add_container(f"{STACK}-started", helper)
    harness.docker.containers[started]["State"]["Status"] = "running"
    harness.docker.add_container("other-helper", {**helper, "tollgate.stack": "other"})
    good = adapter_tar(*GOOD_TAR)
    for name, why in (
        (f"{STACK}-engine", b"only into helper containers"),
        (f"{STACK}-started", b"a helper that was never started"),
        ("other-helper", b"is not Tollgate's"),
    ):
        status, _, answer = raw(harness, "PUT", f"/v1.41/containers/{name}/{PUT_PATH}", good)
        assert status == 403 and why in answer, (name, answer)
    for names, why in (
        (("tollgate-adapters/a-1/ok.json", "hub/models--x/model.safetensors"), b"outside"),
        (("tollgate-adapters/../x",), b"dot part"),
    ):
        target = f"/v1.41/containers/{STACK}-fresh/{PUT_PATH}"
        status, _, answer = raw(harness, "PUT", target, adapter_tar(*names))
        assert status == 403 and b"the archive: " in answer and why in answer, answer
    assert [r.method for r in harness.docker.received if r.method != "GET"] == []
    assert len(refusals(caplog)) == 5
    status, _, _ = raw(harness, "PUT", f"/v1.41/containers/{STACK}-fresh/{PUT_PATH}", good)
    assert status == 200


def test_pull_progress_streams_line_by_line(harness: Harness) -> None:
    """Each progress line reaches the client before Docker has written the next one: the
    fake Engine writes line n+1 only after the test has read line n through the policy."""
    url = f"http://127.0.0.1:{harness.port}/v1.41/images/create?fromImage=tollgate%2Fengine-sim&tag=latest"
    with httpx.stream(
        "POST", url, timeout=10, headers={"X-Registry-Auth": "eyJ1IjoieCJ9"}
    ) as answer:
        assert answer.status_code == 200
        lines = answer.iter_lines()
        for n in range(3):
            harness.release(f"pull-{n}")
            assert json.loads(next(lines))["progressDetail"]["current"] == n
    (received,) = harness.docker.received
    assert received.target == "/v1.41/images/create?fromImage=tollgate%2Fengine-sim&tag=latest"
    assert received.headers["x-registry-auth"] == "eyJ1IjoieCJ9"


def test_a_stream_docker_breaks_off_is_broken_off_for_the_client_too(
    harness: Harness,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not ended cleanly: a client must not take a pull cut short for a finished one."""
    url = f"http://127.0.0.1:{harness.port}/v1.41/images/create?fromImage=tollgate/engine-sim&tag=broken"
    with httpx.stream("POST", url, timeout=10) as answer:
        lines = answer.iter_lines()
        assert json.loads(next(lines)) == {"status": "Pulling fs layer"}
        with pytest.raises(httpx.RemoteProtocolError):
            list(lines)
    assert "broke off" in caplog.text


def test_wait_answers_its_headers_at_once_and_its_body_when_the_container_exits(
    harness: Harness,
) -> None:
    harness.docker.add_container(
        f"{STACK}-w", {"tollgate.managed": "true", "tollgate.stack": STACK}
    )
    url = f"http://127.0.0.1:{harness.port}/v1.41/containers/{STACK}-w/wait?condition=not-running"
    with httpx.stream("POST", url, timeout=10) as answer:
        assert answer.status_code == 200  # headers arrived while the container still runs
        harness.release("wait")
        assert json.loads(answer.read()) == {"StatusCode": 0}


def test_registry_credentials_and_bodies_are_never_logged(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dockerpolicy")
    for n in range(3):
        harness.release(f"pull-{n}")
    raw(
        harness,
        "POST",
        "/v1.41/images/create?fromImage=tollgate/engine-sim&tag=latest",
        None,
        {"X-Registry-Auth": "c2VjcmV0LXBhc3N3b3Jk"},
    )
    raw(
        harness,
        "POST",
        "/v1.41/images/create?fromImage=alpine&tag=latest",
        None,
        {"X-Registry-Auth": "c2VjcmV0LXBhc3N3b3Jk"},
    )
    assert "c2VjcmV0" not in caplog.text and "secret" not in caplog.text
    assert [r.getMessage().split(" ", 1)[0] for r in caplog.records] == ["allowed", "refused"]


def test_head_ping(harness: Harness) -> None:
    status, headers, body = raw(harness, "HEAD", "/_ping")
    assert (status, headers["api-version"], body) == (200, "1.41", b"")
    assert raw(harness, "GET", "/v1.41/_ping")[2] == b"OK"


def test_an_unreachable_docker_is_a_502_that_says_so(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(policy_settings(), policy_socket="/tmp/tgdp-no-such-socket")
    h.start()
    try:
        status, _, body = raw(h, "GET", "/_ping")
        assert status == 502 and b"the Docker Engine is unreachable" in body
        assert "Docker unreachable for GET /_ping" in caplog.text
    finally:
        h.stop()


def test_an_oversized_or_upgrading_request_is_refused(harness: Harness) -> None:
    status, _, answer = raw(
        harness,
        "POST",
        f"/v1.41/containers/create?name={STACK}-x",
        b'{"Image": "' + b"a" * (2 * 2**20) + b'"}',
        {"Content-Type": "application/json"},
    )
    assert status == 403 and b"larger than" in answer
    status, _, answer = raw(
        harness, "GET", "/_ping", None, {"Upgrade": "tcp", "Connection": "Upgrade"}
    )
    assert status == 403 and b"upgrades" in answer
    assert harness.docker.received == []
