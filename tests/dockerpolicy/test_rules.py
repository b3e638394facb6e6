"""``rules.decide``: which calls pass, in which canonical form, and why others are refused.
Pure decisions, no I/O (the proxy and the docker stage test the wire and a real Engine)."""

import json

import pytest

from dockerpolicy.rules import Call, Forward, Refuse, decide, streams_body
from dockerpolicy.settings import Settings, SettingsError

S = Settings(
    images=("tollgate/engine-sim:*", "vllm/vllm-openai:*", "nvcr.io/nvidia/vllm:*"),
    volumes=frozenset({"st-models", "st-compile"}),
    networks=frozenset({"st-net"}),
    stack="st",
    allow_host_network=False,
    log_allowed=False,
)
JSON = {"content-type": "application/json"}
LABELS = {
    "tollgate.managed": "true",
    "tollgate.stack": "st",
    "tollgate.node": "n",
    "tollgate.role": "engine",
}


def call(
    method: str,
    target: str,
    body: object = b"",
    headers: dict | None = None,
    settings: Settings = S,
) -> Forward | Refuse:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return decide(
        Call(method, target, headers if headers is not None else (JSON if data else {}), data),
        settings,
    )


def engine(**host: object) -> dict:
    """The body the Docker SDK sends for an engine (deployments/runtime.create_engine)."""
    return {
        "Tty": False,
        "OpenStdin": False,
        "StdinOnce": False,
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "Env": ["HF_TOKEN=x", "SIM_TTFT_MS=1"],
        "Cmd": ["m", "--port", "8000"],
        "Image": "tollgate/engine-sim:latest",
        "Volumes": {"/root/.cache/huggingface": {}, "/root/.cache/vllm": {}},
        "NetworkDisabled": False,
        "Labels": LABELS,
        "ExposedPorts": {"8000/tcp": {}},
        "HostConfig": {
            "NetworkMode": "default",
            "SecurityOpt": ["no-new-privileges"],
            "Binds": ["st-models:/root/.cache/huggingface:rw", "st-compile:/root/.cache/vllm:rw"],
            "PortBindings": {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]},
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "50m", "max-file": "3"}},
            "ShmSize": 17179869184,
            "DeviceRequests": [
                {
                    "Driver": "",
                    "Count": -1,
                    "DeviceIDs": [],
                    "Capabilities": [["gpu"]],
                    "Options": {},
                }
            ],
            "Ulimits": [
                {"Name": "memlock", "Soft": -1, "Hard": -1},
                {"Name": "stack", "Soft": 67108864, "Hard": 67108864},
            ],
            **host,
        },
    }


def reason(decision: Forward | Refuse) -> str:
    assert isinstance(decision, Refuse), decision
    return decision.reason


# --- What the worker sends passes, canonically ---------------------------------------------------


def test_an_engine_create_passes_and_is_forwarded_as_decoded() -> None:
    decision = call("POST", "/v1.41/containers/create?name=st-tiny-0", engine())
    assert isinstance(decision, Forward)
    assert (decision.method, decision.path, decision.query) == (
        "POST",
        "/v1.41/containers/create",
        "name=st-tiny-0",
    )
    assert json.loads(decision.body) == engine()
    assert decision.body == json.dumps(engine(), sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "host",
    [
        {"NetworkMode": "st-net"},  # the engine network (the appliance: no published port)
        {"NetworkMode": "bridge", "ShmSize": 0},
        {"NanoCpus": 1_500_000_000},  # the cpu profile on a two-core node
        {
            "DeviceRequests": [
                {
                    "Driver": "nvidia",
                    "DeviceIDs": ["0", "GPU-8c1f"],
                    "Capabilities": [["gpu", "utility", "compute"]],
                }
            ]
        },
        {"LogConfig": {"Type": "local", "Config": {"max-size": "10m", "compress": "true"}}},
        {
            "SecurityOpt": ["no-new-privileges:true"],
            "Ulimits": [{"Name": "nofile", "Soft": 65536, "Hard": 65536}],
        },
        {
            "Privileged": False,
            "CapAdd": None,
            "PidMode": "",
            "OomScoreAdj": 0,
        },  # zero values: as if absent
    ],
)
def test_engine_variants_pass(host: dict) -> None:
    body = engine(**host)
    decision = call("POST", "/v1.41/containers/create?name=st-x", body)
    assert isinstance(decision, Forward), decision
    forwarded = json.loads(decision.body)["HostConfig"]
    assert not {"Privileged", "CapAdd", "PidMode", "OomScoreAdj"} & set(forwarded)


def test_a_staging_helper_and_a_joined_engine_pass() -> None:
    helper = {
        "Image": "vllm/vllm-openai:v0.33.0",
        "Entrypoint": ["hf", "download"],
        "Cmd": ["Qwen/Qwen3-8B"],
        "Env": ["HF_TOKEN=x"],
        "User": "0",
        "Labels": {**LABELS, "tollgate.role": "stage"},
        "Volumes": {"/root/.cache/huggingface": {}},
        "HostConfig": {
            "NetworkMode": "default",
            "SecurityOpt": ["no-new-privileges"],
            "Binds": ["st-models:/root/.cache/huggingface:rw"],
        },
    }
    assert isinstance(call("POST", "/v1.41/containers/create?name=st-stage-7", helper), Forward)
    joined = {
        **engine(NetworkMode="st-net"),
        "NetworkingConfig": {"EndpointsConfig": {"st-net": None}},
    }
    assert isinstance(call("POST", "/v1.41/containers/create?name=st-tp-0", joined), Forward)
    sdk_form = {**engine(NetworkMode="st-net"), "NetworkingConfig": {"st-net": None}}  # docker-py 7
    decision = call("POST", "/v1.41/containers/create?name=st-tp-0", sdk_form)
    assert json.loads(decision.body)["NetworkingConfig"] == {}  # Docker ignores that key too


@pytest.mark.parametrize(
    ("target", "forwarded"),
    [
        ("/_ping", "/_ping"),
        ("/version", "/version"),
        ("/v1.41/info", "/v1.41/info"),
        ("/v1.041/info", "/v1.41/info"),
        (
            "/v1.41/images/tollgate/engine-sim:latest/json",
            "/v1.41/images/tollgate/engine-sim:latest/json",
        ),
        (
            "/v1.41/images/nvcr.io/nvidia/vllm:25.09-py3/json",
            "/v1.41/images/nvcr.io/nvidia/vllm:25.09-py3/json",
        ),
        (
            "/v1.41/containers/json?limit=-1&all=1&size=0&trunc_cmd=0&filters=%7B%22label%22%3A+%5B%22"
            "tollgate.managed%3Dtrue%22%2C+%22tollgate.stack%3Dst%22%2C+%22tollgate.node%3Dn%22%5D%7D",
            "/v1.41/containers/json?all=1&size=0&limit=-1&filters=%7B%22label%22%3A%7B%22tollgate.managed%3Dtrue"
            "%22%3Atrue%2C%22tollgate.node%3Dn%22%3Atrue%2C%22tollgate.stack%3Dst%22%3Atrue%7D%7D",
        ),
        (
            "/v1.41/networks?filters=%7B%22name%22%3A+%5B%22st-net%22%5D%7D",
            "/v1.41/networks?filters=%7B%22name%22%3A%5B%22st-net%22%5D%7D",
        ),
        ("/v1.41/volumes/st-models", "/v1.41/volumes/st-models"),
    ],
)
def test_read_calls_pass_in_canonical_form(target: str, forwarded: str) -> None:
    decision = call("GET", target)
    assert isinstance(decision, Forward), decision
    assert decision.target() == forwarded


@pytest.mark.parametrize(
    ("method", "target", "forwarded"),
    [
        ("POST", "/v1.41/containers/st-x/start", "/v1.41/containers/ID/start"),
        ("POST", "/v1.41/containers/st-x/stop?t=30", "/v1.41/containers/ID/stop?t=30"),
        (
            "POST",
            "/v1.41/containers/st-x/kill?signal=SIGKILL",
            "/v1.41/containers/ID/kill?signal=SIGKILL",
        ),
        (
            "POST",
            "/v1.41/containers/st-x/wait?condition=not-running",
            "/v1.41/containers/ID/wait?condition=not-running",
        ),
        (
            "GET",
            "/v1.41/containers/st-x/logs?stderr=1&stdout=1&timestamps=0&follow=0&tail=40",
            "/v1.41/containers/ID/logs?stdout=1&stderr=1&timestamps=0&follow=0&tail=40",
        ),
        ("GET", "/v1.41/containers/st-x/json", "/v1.41/containers/ID/json"),
        (
            "DELETE",
            "/v1.41/containers/st-x?v=False&link=False&force=True",
            "/v1.41/containers/ID?v=0&force=1",
        ),
        ("GET", "/v1.41/networks/0123abc", "/v1.41/networks/ID"),
    ],
)
def test_container_calls_name_their_owner_for_the_label_check(
    method: str, target: str, forwarded: str
) -> None:
    decision = call(method, target)
    assert isinstance(decision, Forward) and decision.owner == target.split("/")[3].split("?")[0]
    assert decision.target("ID") == forwarded


def test_a_pull_passes_with_its_tag_or_digest_and_registry_credentials() -> None:
    decision = call(
        "POST",
        "/v1.41/images/create?tag=v0.33.0&fromImage=vllm%2Fvllm-openai",
        b"",
        {"x-registry-auth": "e30="},
    )
    assert decision.target() == "/v1.41/images/create?fromImage=vllm%2Fvllm-openai&tag=v0.33.0"
    assert decision.registry_auth == "e30="
    digest = "sha256:" + "a" * 64
    decision = call("POST", f"/v1.41/images/create?fromImage=vllm/vllm-openai:v1%40{digest}")
    assert (
        decision.query == f"fromImage=vllm%2Fvllm-openai&tag={digest.replace(':', '%3A')}"
    )  # the digest wins
    decision = call(
        "POST",
        f"/v1.41/images/create?fromImage=tollgate/engine-sim&tag={digest}",
        settings=Settings(**{**S.__dict__, "images": ("tollgate/engine-sim@*",)}),
    )
    assert (
        decision.target()
        == f"/v1.41/images/create?fromImage=tollgate%2Fengine-sim&tag={digest.replace(':', '%3A')}"
    )


def test_network_and_volume_creation_of_the_engine_network_and_the_caches_pass() -> None:
    decision = call(
        "POST",
        "/v1.41/networks/create",
        {"Name": "st-net", "Driver": "bridge", "Labels": {"tollgate.managed": "true"}},
    )
    assert json.loads(decision.body) == {
        "Driver": "bridge",
        "Labels": {"tollgate.managed": "true"},
        "Name": "st-net",
    }
    decision = call(
        "POST",
        "/v1.41/volumes/create",
        {"Name": "st-models", "Driver": "local", "Labels": {"a": "b"}},
    )
    assert isinstance(decision, Forward)


def test_host_networking_passes_only_where_allowed() -> None:
    body = engine(NetworkMode="host")
    del body["HostConfig"]["PortBindings"]
    assert "TOLLGATE_ALLOW_HOST_NETWORK=true" in reason(
        call("POST", "/v1.41/containers/create?name=st-h", body)
    )
    allowing = Settings(**{**S.__dict__, "allow_host_network": True})
    assert isinstance(
        call("POST", "/v1.41/containers/create?name=st-h", body, settings=allowing), Forward
    )


# --- Refusals and their reasons ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ({"Privileged": True}, "HostConfig.Privileged is not allowed"),
        ({"IpcMode": "host"}, "HostConfig.IpcMode is not allowed"),
        ({"MaskedPaths": []}, "HostConfig.MaskedPaths is not allowed"),
        ({"Binds": ["/:/host"]}, "HostConfig.Binds[0] mounts '/'"),
        ({"Binds": ["st-models:/x:rw,rshared"]}, "the mode may be rw or ro only"),
        ({"Binds": ["st-models:/x/../../etc"]}, "plain absolute path"),
        ({"Binds": ["st-models"]}, "not of the form"),
        ({"NetworkMode": "container:abc"}, "HostConfig.NetworkMode 'container:abc' is not allowed"),
        (
            {"SecurityOpt": ["no-new-privileges", "seccomp=unconfined"]},
            "'seccomp=unconfined' is not allowed",
        ),
        ({"LogConfig": {"Type": "syslog", "Config": {}}}, "LogConfig.Type 'syslog'"),
        ({"LogConfig": {"Type": "json-file", "Config": {"env": "HF_TOKEN"}}}, "the option 'env'"),
        ({"DeviceRequests": [{"Driver": "cdi", "DeviceIDs": ["x.com/y=all"]}]}, "Driver 'cdi'"),
        ({"DeviceRequests": [{"Count": 1}]}, "must ask for the gpu capability"),
        ({"DeviceRequests": [{"Count": 1, "Capabilities": [["gpu", "display"]]}]}, "Capabilities"),
        (
            {"DeviceRequests": [{"Count": 1, "Capabilities": [["gpu"]], "Options": {"a": "b"}}]},
            "Options",
        ),
        ({"Ulimits": [{"Name": "rtprio", "Soft": 99, "Hard": 99}]}, "Ulimits[0]"),
        ({"PortBindings": {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "2375"}]}}, "host port"),
        ({"PortBindings": {"8000/udp": [{}]}}, "only <port>/tcp"),
        ({"PortBindings": {"8000/tcp": [{"HostIp": "localhost"}]}}, "HostIp must be an IP address"),
        ({"ShmSize": -1}, "must not be negative"),
        ({"NanoCpus": -1}, "HostConfig.NanoCpus must not be negative"),
        ({"CpuQuota": 50000}, "HostConfig.CpuQuota is not allowed"),
    ],
)
def test_host_config_refusals_name_the_field(host: dict, why: str) -> None:
    assert why in reason(call("POST", "/v1.41/containers/create?name=st-x", engine(**host)))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"Image": "alpine:latest"}, "'alpine:latest' is not an allowed engine image"),
        ({"Image": "docker.io/tollgate/engine-sim:latest"}, "not an allowed engine image"),
        ({"Image": "tollgate/engine-sim"}, "not an allowed engine image"),
        (
            {"Image": "Tollgate/engine-sim:latest"},
            "not an allowed engine image",
        ),  # a registry "Tollgate"
        ({"Image": "tollgate/Engine-sim:latest"}, "not a valid image reference"),
        ({"Image": ""}, "Image is missing"),
        ({"Labels": {**LABELS, "tollgate.managed": "false"}}, "tollgate.managed=true"),
        ({"Labels": {**LABELS, "tollgate.stack": "other"}}, "tollgate.stack=st"),
        ({"Labels": {**LABELS, "com.docker.compose.project": "x"}}, "only tollgate.* labels"),
        ({"Volumes": {"/host": {}}}, "not where an allowed volume is mounted"),
        ({"Healthcheck": {"Test": ["CMD", "true"]}}, "Healthcheck is not allowed"),
        ({"NetworkingConfig": {"EndpointsConfig": {"bridge": {}}}}, "only the engine network"),
        (
            {
                "NetworkingConfig": {
                    "EndpointsConfig": {"st-net": {"IPAMConfig": {"IPv4Address": "10.0.0.9"}}}
                }
            },
            "IPAMConfig is not allowed",
        ),
    ],
)
def test_config_refusals(change: dict, why: str) -> None:
    assert why in reason(call("POST", "/v1.41/containers/create?name=st-x", {**engine(), **change}))


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("/v1.41/containers/create", "'name' is required"),
        ("/v1.41/containers/create?name=other-x", "must start with st-"),
        ("/v1.41/containers/create?name=st-x&platform=linux", "'platform' is not allowed"),
        ("/v1.41/containers/create?name=st-x&name=st-y", "more than once"),
        ("/v1.41/containers/create?name=st-x;name=other", "semicolon"),
        ("/v1.41/containers/create?name=st-%zz", "malformed percent-escape"),
        ("/v1.41//containers/create?name=st-x", "empty segment"),
        ("/v1.41/containers/create/?name=st-x", "empty segment"),
        ("/v1.41/./containers/create?name=st-x", "dot segment"),
        ("/v1.41/containers/x/../create?name=st-x", "dot segment"),
        ("/v1.41/containers%2Fcreate?name=st-x", "characters no Docker path needs"),
        ("/V1.41/containers/create?name=st-x", "is not a call"),
        ("/v1.23/containers/create?name=st-x", "API version 1.23 is not supported"),
        ("/v2.0/containers/create?name=st-x", "not supported"),
        ("http://docker/v1.41/containers/create?name=st-x", "absolute path"),
        ("/v1.41/containers/create?name=st-x#f", "fragment"),
    ],
)
def test_target_refusals(target: str, why: str) -> None:
    assert why in reason(call("POST", target, engine()))


def test_a_body_needs_the_json_content_type_and_bodyless_calls_take_none() -> None:
    assert "application/json" in reason(
        call(
            "POST",
            "/v1.41/containers/create?name=st-x",
            json.dumps(engine()).encode(),
            {"content-type": "text/plain"},
        )
    )
    assert "takes no body" in reason(
        call("POST", "/v1.41/containers/st-x/start", {"HostConfig": {"Privileged": True}})
    )


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("/v1.41/containers/json", "'filters' is required"),
        ("/v1.41/containers/json?filters=%7B%7D", "only label filters"),
        (
            "/v1.41/containers/json?filters=" + json.dumps({"label": ["tollgate.managed=true"]}),
            "tollgate.stack=st",
        ),
        (
            "/v1.41/containers/json?filters=" + json.dumps({"label": ["tollgate.stack=st"]}),
            "tollgate.managed=true",
        ),
        (
            "/v1.41/containers/json?filters="
            + json.dumps({"label": ["tollgate.managed=true", "tollgate.stack=st"], "name": ["db"]}),
            "only label filters",
        ),
        (
            "/v1.41/containers/json?filters="
            + json.dumps({"label": {"tollgate.managed=true": True, "tollgate.stack=st": True}})
            + "&limit=1e3",
            "limit: not an integer",
        ),
        ("/v1.41/networks", "'filters' is required"),
        ("/v1.41/networks?filters=" + json.dumps({"name": ["bridge"]}), "only the engine network"),
        ("/v1.41/volumes/db", "only the model and compile cache"),
        ("/v1.41/images/alpine:3/json", "'alpine:3' is not an allowed engine image"),
        ("/v1.41/images/json", "GET /images/json is not a call"),
        ("/v1.41/images/tollgate/engine-sim:la%74est/json", "characters no Docker path needs"),
        ("/v1.41/containers/st-x/logs?tail=-all", "tail: all or a number"),
        ("/v1.41/containers/st-x/logs?details=1", "'details' is not allowed"),
    ],
)
def test_read_refusals(target: str, why: str) -> None:
    assert why in reason(call("GET", target))


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("fromImage=alpine&tag=latest", "'alpine:latest' is not an allowed engine image"),
        ("fromImage=tollgate/engine-sim", "needs a tag or a digest"),
        ("fromImage=tollgate/engine-sim:latest&tag=other", "given both"),
        ("fromImage=tollgate/engine-sim&tag=a/b", "not a valid tag"),
        ("fromImage=tollgate/engine-sim&tag=latest&fromSrc=-", "'fromSrc' is not allowed"),
        (
            "fromImage=tollgate/engine-sim&tag=latest&platform=linux%2Farm64",
            "'platform' is not allowed",
        ),
        (
            "fromImage=evil.example:5000/tollgate/engine-sim&tag=latest",
            "not an allowed engine image",
        ),
        ("tag=latest", "'fromImage' is required"),
    ],
)
def test_pull_refusals(query: str, why: str) -> None:
    assert why in reason(call("POST", f"/v1.41/images/create?{query}"))


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("POST", "/v1.41/containers/st-x/exec"),
        ("POST", "/v1.41/exec/abc/start"),
        ("POST", "/v1.41/containers/st-x/attach"),
        ("POST", "/v1.41/containers/st-x/restart"),
        ("POST", "/v1.41/containers/st-x/update"),
        ("POST", "/v1.41/build"),
        ("POST", "/v1.41/commit"),
        ("POST", "/v1.41/images/load"),
        ("DELETE", "/v1.41/images/tollgate/engine-sim:latest"),
        ("POST", "/v1.41/plugins/pull"),
        ("POST", "/v1.41/swarm/init"),
        ("GET", "/v1.41/secrets"),
        ("GET", "/v1.41/events"),
        ("DELETE", "/v1.41/volumes/st-models"),
        ("POST", "/v1.41/networks/st-net/connect"),
        ("GET", "/v1.41/containers/st-x/json/extra"),
        ("OPTIONS", "/_ping"),
        ("POST", "/_ping"),
    ],
)
def test_calls_outside_the_engine_lifecycle_are_refused(method: str, target: str) -> None:
    assert "is not a call Tollgate's engines need" in reason(call(method, target))


# --- Archives: an uploaded adapter into a helper's model cache, and nothing else -------------


def test_an_archive_into_the_model_cache_of_a_helper_passes_and_is_streamed() -> None:
    target = "/v1.41/containers/st-adapter-copy-7/archive?path=%2Froot%2F.cache%2Fhuggingface"
    decision = call("PUT", target, headers={})
    assert isinstance(decision, Forward)
    assert decision.target("f" * 64) == (
        f"/v1.41/containers/{'f' * 64}/archive"
        "?path=%2Froot%2F.cache%2Fhuggingface&noOverwriteDirNonDir=1"
    )
    # The owner must be Tollgate's (and a never started helper: checked by the server), and
    # the body is the client's tar, checked to stay in tollgate-adapters/ as it streams.
    assert decision.owner == "st-adapter-copy-7" and decision.tar_under == "tollgate-adapters"
    assert streams_body("PUT", target) and streams_body("PUT", "/containers/x/archive?path=/")
    assert not streams_body("GET", target) and not streams_body("PUT", "/containers/create")


@pytest.mark.parametrize(
    ("query", "headers", "why"),
    [
        ("path=/", {}, "only into the model cache (/root/.cache/huggingface)"),
        ("path=/root/.cache/huggingface/hub", {}, "under its tollgate-adapters/ folder"),
        ("path=/root/.cache/huggingface/tollgate-adapters", {}, "only into the model cache"),
        ("path=/root/.cache/vllm", {}, "only into the model cache"),
        ("path=/root/.cache/huggingface/", {}, "only into the model cache"),
        ("", {}, "the query parameter 'path' is required"),
        ("path=/root/.cache/huggingface&copyUIDGID=1", {}, "copyUIDGID is not allowed"),
        ("path=/root/.cache/huggingface&x=1", {}, "'x' is not allowed"),
        ("path=/root/.cache/huggingface", JSON, "must be a tar archive"),
    ],
)
def test_archive_refusals(query: str, headers: dict, why: str) -> None:
    target = f"/v1.41/containers/st-x/archive?{query}" if query else "/containers/st-x/archive"
    assert why in reason(call("PUT", target, headers=headers))


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "DELETE"])
def test_archives_are_never_read_from_a_container(method: str) -> None:
    target = "/v1.41/containers/st-x/archive?path=/root/.cache/huggingface"
    assert "is not a call Tollgate's engines need" in reason(call(method, target))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            {"Name": "st-net", "Driver": "macvlan", "Labels": {"tollgate.managed": "true"}},
            "only bridge",
        ),
        (
            {"Name": "st-net", "Options": {"com.docker.network.bridge.name": "docker0"}},
            "Options is not allowed",
        ),
        ({"Name": "st-net", "IPAM": {"Config": [{"Subnet": "10.0.0.0/8"}]}}, "IPAM is not allowed"),
        ({"Name": "other", "Labels": {"tollgate.managed": "true"}}, "only the engine network"),
        ({"Name": "st-net"}, "tollgate.managed=true"),
    ],
)
def test_network_create_refusals(body: dict, why: str) -> None:
    assert why in reason(call("POST", "/v1.41/networks/create", body))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            {"Name": "st-models", "DriverOpts": {"type": "none", "o": "bind", "device": "/"}},
            "DriverOpts is not allowed",
        ),
        ({"Name": "st-models", "Driver": "rexray"}, "only local volumes"),
        ({"Name": "db"}, "only the volumes"),
    ],
)
def test_volume_create_refusals(body: dict, why: str) -> None:
    assert why in reason(call("POST", "/v1.41/volumes/create", body))


def test_settings_come_from_the_appliance_s_variables() -> None:
    settings = Settings.from_env(
        {
            "TOLLGATE_STACK_ID": "s1",
            "TOLLGATE_ENGINE_IMAGES": "a:*, b:*",
            "TOLLGATE_MODEL_CACHE_VOLUME": "m",
            "TOLLGATE_COMPILE_CACHE_VOLUME": "c",
            "TOLLGATE_ENGINE_NETWORK": "n",
            "TOLLGATE_ALLOW_HOST_NETWORK": "true",
            "TOLLGATE_DOCKER_POLICY_LOG": "all",
        }
    )
    assert settings == Settings(
        images=("a:*", "b:*"),
        volumes=frozenset({"m", "c"}),
        networks=frozenset({"n"}),
        stack="s1",
        allow_host_network=True,
        log_allowed=True,
    )
    assert (
        Settings.from_env({}).stack == "tollgate" and not Settings.from_env({}).allow_host_network
    )
    with pytest.raises(SettingsError):
        Settings.from_env({"TOLLGATE_ALLOW_HOST_NETWORK": "maybe"})
    with pytest.raises(SettingsError):
        Settings.from_env({"TOLLGATE_ENGINE_IMAGES": " , "})
