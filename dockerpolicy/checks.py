"""The bodies the policy accepts: container, network and volume creation, checked field by
field on the decoded value and returned in the canonical form that is forwarded.

Each check raises ``Refused`` with the reason that goes into the 403 answer and the log
line. Reasons name fields and policy values (images, volumes, networks, options) and never
an environment value or a command line.
"""

import fnmatch
import ipaddress
import re
from typing import Any

from dockerpolicy import dockertypes
from dockerpolicy.gojson import DecodeError, decode
from dockerpolicy.settings import Settings
from dockerpolicy.targets import TargetError, parse_image

LABEL_MANAGED, LABEL_STACK = "tollgate.managed", "tollgate.stack"
NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}/tcp", re.ASCII)
_MOUNT_TARGET = re.compile(r"(/[A-Za-z0-9_.-]+)+", re.ASCII)
_SIZE = re.compile(r"[0-9]{1,12}[kmgKMG]?", re.ASCII)
_DEVICE_ID = re.compile(r"[A-Za-z0-9-]{1,64}", re.ASCII)

# What the engine lifecycle sends (deployments/runtime.py through the Docker SDK); any
# other field Docker knows must be absent or left at its zero value.
CONFIG_ALLOWED = frozenset(
    {
        "Image",
        "Cmd",
        "Entrypoint",
        "Env",
        "Labels",
        "User",
        "ExposedPorts",
        "Volumes",
        "Tty",
        "OpenStdin",
        "StdinOnce",
        "AttachStdin",
        "AttachStdout",
        "AttachStderr",
        "NetworkDisabled",
        "HostConfig",
        "NetworkingConfig",
    }
)
HOST_CONFIG_ALLOWED = frozenset(
    {
        "Binds",
        "NetworkMode",
        "PortBindings",
        "LogConfig",
        "SecurityOpt",
        "DeviceRequests",
        "Ulimits",
        "ShmSize",
        "NanoCpus",  # a CPU limit only lowers what the container may take
    }
)
NO_NEW_PRIVILEGES = frozenset(
    {"no-new-privileges", "no-new-privileges:true", "no-new-privileges=true"}
)
LOG_DRIVERS = frozenset({"", "json-file", "local"})
LOG_OPTIONS = frozenset({"max-size", "max-file", "compress"})
GPU_DRIVERS = frozenset({"", "nvidia"})
GPU_CAPABILITIES = frozenset({"gpu", "nvidia", "compute", "utility"})
ULIMITS = frozenset({"memlock", "stack", "nofile"})


class Refused(Exception):
    """The request is refused; the message says why."""


def is_set(value: Any) -> bool:
    """Whether a decoded field changes anything: false, 0 and "" leave Docker's default;
    any list or object, even empty, does not (``"MaskedPaths": []`` unmasks /proc)."""
    return not (value is False or value == 0 or value == "")


def only(fields: dict[str, Any], allowed: frozenset[str], where: str) -> dict[str, Any]:
    """``fields`` less those left at zero; refused when a field outside ``allowed`` is set."""
    kept = {}
    for name, value in fields.items():
        if name in allowed:
            kept[name] = value
        elif is_set(value):
            raise Refused(f"{where}{name} is not allowed")
    return kept


def decoded(body: bytes, gotype: Any) -> dict[str, Any]:
    try:
        return decode(body, gotype)
    except DecodeError as exc:
        raise Refused(str(exc)) from None


def check_image(text: str, settings: Settings, where: str = "Image") -> str:
    try:
        ref = str(parse_image(text))
    except TargetError as exc:
        raise Refused(f"{where}: {exc}") from None
    if not any(fnmatch.fnmatchcase(ref, pattern) for pattern in settings.images):
        raise Refused(
            f"{where} {ref!r} is not an allowed engine image "
            f"(TOLLGATE_ENGINE_IMAGES: {', '.join(settings.images)})"
        )
    return ref


def check_labels(labels: dict[str, str], settings: Settings, stack: bool = True) -> None:
    for key in labels:
        if not key.startswith("tollgate."):
            raise Refused(f"Labels: only tollgate.* labels may be set, not {key[:64]!r}")
    if labels.get(LABEL_MANAGED) != "true":
        raise Refused(f"Labels must carry {LABEL_MANAGED}=true")
    if stack and labels.get(LABEL_STACK) != settings.stack:
        raise Refused(f"Labels must carry {LABEL_STACK}={settings.stack}")


def check_container_name(name: str, settings: Settings) -> str:
    bare = name[1:] if name.startswith("/") else name
    if not NAME.fullmatch(bare) or len(bare) > 200:
        raise Refused("name: not a valid container name")
    if not bare.startswith(f"{settings.stack}-"):
        raise Refused(f"name: container names must start with {settings.stack}-")
    return bare


# --- Container create ---------------------------------------------------------------------


def check_container_create(body: bytes, settings: Settings) -> dict[str, Any]:
    spec = only(decoded(body, dockertypes.CONTAINER_CREATE), CONFIG_ALLOWED, "")
    host = only(spec.get("HostConfig") or {}, HOST_CONFIG_ALLOWED, "HostConfig.")
    targets = {
        check_bind(bind, settings, f"HostConfig.Binds[{i}]")
        for i, bind in enumerate(host.get("Binds") or [])
    }
    for target in spec.get("Volumes") or {}:
        if target not in targets:
            raise Refused(f"Volumes: {target[:80]!r} is not where an allowed volume is mounted")
    check_ports(spec.get("ExposedPorts") or {}, host.get("PortBindings") or {})
    check_network_mode(host.get("NetworkMode", ""), settings)
    check_log_config(host.get("LogConfig") or {})
    for option in host.get("SecurityOpt") or []:
        if option not in NO_NEW_PRIVILEGES:
            raise Refused(
                f"HostConfig.SecurityOpt {option[:80]!r} is not allowed (only no-new-privileges)"
            )
    for i, request in enumerate(host.get("DeviceRequests") or []):
        check_gpu_request(request, f"HostConfig.DeviceRequests[{i}]")
    for i, limit in enumerate(host.get("Ulimits") or []):
        if limit is None or limit.get("Name") not in ULIMITS:
            raise Refused(f"HostConfig.Ulimits[{i}]: only {', '.join(sorted(ULIMITS))} may be set")
    for name in ("ShmSize", "NanoCpus"):
        if (host.get(name) or 0) < 0:
            raise Refused(f"HostConfig.{name} must not be negative")
    if "HostConfig" in spec:
        spec["HostConfig"] = host
    if "NetworkingConfig" in spec:
        spec["NetworkingConfig"] = check_networking(spec["NetworkingConfig"], settings)
    if not spec.get("Image"):
        raise Refused("Image is missing")
    spec["Image"] = check_image(spec["Image"], settings)
    check_labels(spec.get("Labels") or {}, settings)
    return spec


def check_bind(bind: str, settings: Settings, where: str) -> str:
    """A bind of an allowed named volume (never a host path); its target inside."""
    parts = bind.split(":")
    if len(parts) not in (2, 3):
        raise Refused(f"{where}: not of the form volume:/path[:mode]")
    source, target = parts[0], parts[1]
    if source not in settings.volumes:
        raise Refused(
            f"{where} mounts {source[:80]!r}: only the volumes "
            f"{', '.join(sorted(settings.volumes))} may be mounted"
        )
    if not _MOUNT_TARGET.fullmatch(target) or {".", ".."} & set(target.split("/")):
        raise Refused(f"{where}: the mount point must be a plain absolute path")
    if len(parts) == 3 and parts[2] not in ("rw", "ro"):
        raise Refused(f"{where}: the mode may be rw or ro only")
    return target


def check_ports(exposed: dict[str, Any], bindings: dict[str, Any]) -> None:
    for port in [*exposed, *bindings]:
        if not _PORT.fullmatch(port):
            raise Refused(f"port {port[:20]!r}: only <port>/tcp may be exposed")
    for port, entries in bindings.items():
        for entry in entries or []:
            if entry.get("HostPort", ""):
                raise Refused(
                    f"HostConfig.PortBindings[{port!r}]: the host port must be left to Docker"
                )
            address = entry.get("HostIp", "")
            try:
                if address:
                    ipaddress.ip_address(address)
            except ValueError:
                raise Refused(
                    f"HostConfig.PortBindings[{port!r}]: HostIp must be an IP address"
                ) from None


def check_network_mode(mode: str, settings: Settings) -> None:
    if mode in ("", "default", "bridge") or mode in settings.networks:
        return
    if mode == "host":
        if settings.allow_host_network:
            return
        raise Refused(
            "HostConfig.NetworkMode host is not allowed (TOLLGATE_ALLOW_HOST_NETWORK=true "
            "allows it, for two-box tensor parallelism)"
        )
    raise Refused(
        f"HostConfig.NetworkMode {mode[:80]!r} is not allowed (the engine network "
        f"{', '.join(sorted(settings.networks))}, bridge or default)"
    )


def check_log_config(config: dict[str, Any]) -> None:
    if config.get("Type", "") not in LOG_DRIVERS:
        raise Refused(
            f"HostConfig.LogConfig.Type {config['Type'][:40]!r} is not allowed (json-file or local)"
        )
    for name, value in (config.get("Config") or {}).items():
        if name not in LOG_OPTIONS:
            raise Refused(f"HostConfig.LogConfig.Config: the option {name[:40]!r} is not allowed")
        if not (_SIZE.fullmatch(value) or value in ("true", "false")):
            raise Refused(f"HostConfig.LogConfig.Config[{name!r}] is not a size or a count")


def check_gpu_request(request: dict[str, Any], where: str) -> None:
    """GPUs through the NVIDIA Container Toolkit, and nothing else a device request can do."""
    if request.get("Driver", "") not in GPU_DRIVERS:
        raise Refused(f"{where}.Driver {request['Driver'][:40]!r} is not allowed (nvidia)")
    if request.get("Options"):
        raise Refused(f"{where}.Options are not allowed")
    for device in request.get("DeviceIDs") or []:
        if not _DEVICE_ID.fullmatch(device):
            raise Refused(f"{where}.DeviceIDs: {device[:80]!r} is not a GPU index or UUID")
    capabilities = request.get("Capabilities") or []
    if not capabilities:
        raise Refused(f"{where}: a device request must ask for the gpu capability")
    for group in capabilities:
        if "gpu" not in group or not set(group) <= GPU_CAPABILITIES:
            raise Refused(
                f"{where}.Capabilities: only {', '.join(sorted(GPU_CAPABILITIES))} "
                "with gpu are allowed"
            )


def check_networking(config: dict[str, Any], settings: Settings) -> dict[str, Any]:
    joined = {}
    for network, endpoint in (config.get("EndpointsConfig") or {}).items():
        where = f"NetworkingConfig.EndpointsConfig[{network[:80]!r}]"
        if network not in settings.networks:
            raise Refused(f"{where}: only the engine network may be joined")
        joined[network] = (
            None if endpoint is None else only(endpoint, frozenset({"Aliases"}), f"{where}.")
        )
        for alias in (endpoint or {}).get("Aliases") or []:
            if not NAME.fullmatch(alias):
                raise Refused(f"{where}.Aliases: {alias[:80]!r} is not a plain name")
    return {"EndpointsConfig": joined} if "EndpointsConfig" in config else {}


# --- Networks and volumes -----------------------------------------------------------------

NETWORK_ALLOWED = frozenset({"Name", "CheckDuplicate", "Driver", "Internal", "Labels"})
VOLUME_ALLOWED = frozenset({"Name", "Driver", "Labels"})


def check_network_create(body: bytes, settings: Settings) -> dict[str, Any]:
    spec = only(decoded(body, dockertypes.NETWORK_CREATE), NETWORK_ALLOWED, "")
    if spec.get("Name") not in settings.networks:
        raise Refused(
            f"Name: only the engine network {', '.join(sorted(settings.networks))} may be created"
        )
    if spec.get("Driver", "") not in ("", "bridge"):
        raise Refused("Driver: only bridge networks may be created")
    check_labels(spec.get("Labels") or {}, settings, stack=False)
    return spec


def check_volume_create(body: bytes, settings: Settings) -> dict[str, Any]:
    spec = only(decoded(body, dockertypes.VOLUME_CREATE), VOLUME_ALLOWED, "")
    if spec.get("Name") not in settings.volumes:
        raise Refused(
            f"Name: only the volumes {', '.join(sorted(settings.volumes))} may be created"
        )
    if spec.get("Driver", "") not in ("", "local"):
        raise Refused("Driver: only local volumes may be created")
    return spec
