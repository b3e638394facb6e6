"""dockerpolicy's decoder against Docker Engine's own: the same bytes posted straight to the
Docker socket (no policy), the container Docker creates (never started, removed at once)
inspected, and compared with what ``gojson.decode`` reads.

Where the policy accepts a body, Docker must read it exactly as the policy did. Where the
policy refuses (a field given twice), Docker shows why: it would have used the last value
or merged the objects. Unicode folding of i (U+0130, U+0131) is Go 1.21's; an Engine built
with an older Go ignores such a key, which the test expects from the Engine's GoVersion.
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable, Iterator
from typing import Any

import docker
import pytest

from dockerpolicy import dockertypes
from dockerpolicy.gojson import DecodeError, decode
from tests import leaks
from tests.dockerpolicy.process import docker_socket

pytestmark = pytest.mark.docker

IMG = "tollgate/engine-sim:latest"
REFUSED, REJECTED = "refused by the policy", "rejected by Docker"
ZERO = {
    "Privileged": False,
    "PidMode": "",
    "CapAdd": None,
    "Binds": None,
    "NetworkMode": "default",
    "CpuShares": 0,
    "ShmSize": 67108864,
    "Image": None,
}


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("docker", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


@pytest.fixture(scope="module")
def engine() -> Iterator[Callable[[bytes], Any]]:
    """Create a container from raw bytes straight on the Docker socket; its inspect, or
    REJECTED. Every container is removed before the next call."""
    client = docker.from_env()

    def create(body: bytes) -> Any:
        conn = UnixConnection(docker_socket())
        name = leaks.unique_name("tgdiff")
        conn.request(
            "POST",
            f"/v1.41/containers/create?name={name}",
            body=body,
            headers={"Content-Type": "application/json"},
        )
        answer = conn.getresponse()
        answer.read()
        conn.close()
        if answer.status in (400, 500):  # Docker 20.10 answers 500 for a type mismatch
            return REJECTED
        assert answer.status == 201, answer.status
        container = client.containers.get(name)
        try:
            return container.attrs
        finally:
            container.remove(force=True)

    yield create


@pytest.fixture(scope="module")
def modern_go() -> bool:
    version = docker.from_env().version()["GoVersion"].removeprefix("go").split(".")
    return (int(version[0]), int(version[1])) >= (1, 21)


def host(text: str) -> bytes:
    return (
        '{"Image": "IMG", "HostConfig": {TEXT}}'.replace("IMG", IMG).replace("TEXT", text)
    ).encode()


CASES: list[tuple[str, bytes, str, Any, Any]] = [
    # id, body, field, what Docker does, what the policy decodes
    ("exact", host('"Privileged": true'), "Privileged", True, True),
    ("lower-case", host('"privileged": true'), "Privileged", True, True),
    ("upper-case", host('"PRIVILEGED": true'), "Privileged", True, True),
    ("escaped-key", host('"\\u0050rivileged": true'), "Privileged", True, True),
    ("space-before-colon", host('"Privileged" : true'), "Privileged", True, True),
    ("long-s", host('"Bind\u017f": ["/tmp:/x"]'), "Binds", ["/tmp:/x"], ["/tmp:/x"]),
    ("kelvin-sign", host('"Networ\u212aMode": "none"'), "NetworkMode", "none", "none"),
    ("dotless-i", host('"Pr\u0131vileged": true'), "Privileged", "modern-go", True),
    ("escaped-value", host('"PidMode": "\\u0068ost"'), "PidMode", "host", "host"),
    ("escaped-solidus", host('"Binds": ["\\/tmp:\\/x"]'), "Binds", ["/tmp:/x"], ["/tmp:/x"]),
    ("one-string-strslice", host('"CapAdd": "NET_ADMIN"'), "CapAdd", ["NET_ADMIN"], ["NET_ADMIN"]),
    ("unknown-key", host('"Privileged\u200b": true'), "Privileged", False, False),
    ("embedded-struct-name", host('"Resources": {"CpuShares": 512}'), "CpuShares", 0, 0),
    ("promoted-field", host('"CpuShares": 512'), "CpuShares", 512, 512),
    ("null-scalar", host('"Privileged": null'), "Privileged", False, False),
    ("null-slice", host('"CapAdd": null'), "CapAdd", None, None),
    ("lower-case-top-level", b'{"image": "%b"}' % IMG.encode(), "Image", IMG, IMG),
    ("bool-as-number", host('"Privileged": 1'), "Privileged", REJECTED, REFUSED),
    ("bool-as-string", host('"Privileged": "true"'), "Privileged", REJECTED, REFUSED),
    ("int-with-fraction", host('"ShmSize": 1.5'), "ShmSize", REJECTED, REFUSED),
    ("int-with-exponent", host('"ShmSize": 1e8'), "ShmSize", REJECTED, REFUSED),
    ("duplicate-last-wins", host('"PidMode": "", "PidMode": "host"'), "PidMode", "host", REFUSED),
    ("duplicate-case-variant", host('"PidMode": "host", "pidmode": ""'), "PidMode", "", REFUSED),
    (
        "duplicate-null-keeps-the-value",
        host('"Privileged": true, "Privileged": null'),
        "Privileged",
        True,
        REFUSED,
    ),
    (
        "duplicate-struct-merges",
        b'{"Image": "%b", "HostConfig": {"Privileged": true}, "HostConfig": {"PidMode": ""}}'
        % IMG.encode(),
        "Privileged",
        True,
        REFUSED,
    ),
]


def docker_value(attrs: dict[str, Any], field: str) -> Any:
    if field == "Image":
        return attrs["Config"]["Image"]
    return attrs["HostConfig"].get(field)


def policy_value(body: bytes, field: str) -> Any:
    try:
        spec = decode(body, dockertypes.CONTAINER_CREATE)
    except DecodeError:
        return REFUSED
    return spec.get(field, spec.get("HostConfig", {}).get(field, ZERO[field]))


@pytest.mark.parametrize(
    ("case_id", "data", "field", "by_docker", "by_policy"), CASES, ids=[c[0] for c in CASES]
)
def test_docker_reads_what_the_policy_reads(
    engine: Callable,
    modern_go: bool,
    case_id: str,
    data: bytes,
    field: str,
    by_docker: Any,
    by_policy: Any,
) -> None:
    if by_docker == "modern-go":
        by_docker = modern_go
    attrs = engine(data)
    assert (REJECTED if attrs == REJECTED else docker_value(attrs, field)) == by_docker
    assert policy_value(data, field) == by_policy


def test_labels_are_a_map_with_exact_keys_and_the_last_duplicate(engine: Callable) -> None:
    attrs = engine(b'{"Image": "%b", "Labels": {"a\\u0062": "1", "AB": "2"}}' % IMG.encode())
    assert attrs["Config"]["Labels"] == {"ab": "1", "AB": "2"}
    duplicate = b'{"Image": "%b", "Labels": {"k": "1", "k": "2"}}' % IMG.encode()
    assert engine(duplicate)["Config"]["Labels"] == {"k": "2"}
    with pytest.raises(DecodeError, match="more than once"):
        decode(duplicate, dockertypes.CONTAINER_CREATE)


def test_a_canonical_body_means_to_docker_what_the_original_meant(engine: Callable) -> None:
    """The policy forwards its re-serialisation: Docker creates the same container from it."""
    from dockerpolicy.gojson import encode

    original = (
        (
            '{"image": "IMG", "hostconfig": {"Bind\u017f": ["/tmp:/x:ro"], "\\u0050idMode": "host",'
            ' "cAPaDD": "NET_ADMIN", "Unknown": 1}, "LABELS": {"k": "v"}, "env": ["A=\\u0042"]}'
        )
        .replace("IMG", IMG)
        .encode()
    )
    canonical = encode(decode(original, dockertypes.CONTAINER_CREATE))
    first, second = engine(original), engine(canonical)
    for attrs in (first, second):
        attrs["Config"].pop("Hostname")
        for volatile in (
            "Id",
            "Name",
            "Created",
            "ResolvConfPath",
            "HostnamePath",
            "HostsPath",
            "LogPath",
            "GraphDriver",
            "NetworkSettings",
            "State",
            "Mounts",
        ):
            attrs.pop(volatile, None)
    assert first == second
    assert first["HostConfig"]["Binds"] == ["/tmp:/x:ro"] and first["Config"]["Env"][0] == "A=B"
