"""Which Docker API calls pass, and in which canonical form.

``decide`` maps one incoming call (method, raw target, headers, body) to a ``Forward`` — the
request Docker will receive, rebuilt from what was checked — or a ``Refuse`` with its
reason. It does no I/O: the one fact it cannot know, whether a container is Tollgate's, is
left to the server as ``Forward.owner`` (it inspects the container and checks its labels
before acting, and then acts on the full id it found).

Allowed: exactly what the engine lifecycle (deployments/runtime.py through the Docker SDK)
and the janitor use. Everything else is refused.

One call takes a body that is not read first: an archive put into a helper's model cache
(an uploaded LoRA adapter). ``streams_body`` tells the server so; the decision names the
folder the stream must stay in, and the server checks the tar as it forwards it
(``dockerpolicy.tarstream``).
"""

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dockerpolicy import checks, dockertypes
from dockerpolicy.checks import LABEL_MANAGED, LABEL_STACK, Refused
from dockerpolicy.gojson import DecodeError, encode, parse
from dockerpolicy.settings import Settings
from dockerpolicy.targets import Target, TargetError, encode_query, parse_target, pull_reference

MAX_BODY = 1024 * 1024
_INT = re.compile(r"-?[0-9]{1,10}", re.ASCII)
_TIMESTAMP = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?", re.ASCII)
_SIGNAL = re.compile(r"(SIG)?[A-Z0-9]{1,12}|[0-9]{1,2}", re.ASCII)
_ID = r"(?P<id>[a-zA-Z0-9][a-zA-Z0-9_.-]*)"


@dataclass(frozen=True)
class Call:
    """An incoming request as received (the target undecoded)."""

    method: str
    target: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes


@dataclass(frozen=True)
class Forward:
    """The request Docker receives. ``{id}`` in ``path`` stands for ``owner``'s full id."""

    method: str
    path: str
    query: str = ""
    body: bytes | None = None
    registry_auth: str = ""  # X-Registry-Auth of a pull, passed through, never logged
    owner: str = ""  # the container (or network) that must be Tollgate's: checked first
    owner_kind: str = "container"  # or "network"
    inspect_is_answer: bool = False  # an inspect call: the owner check's answer is the answer
    # An archive put: the owner must also be a created, never started, helper (role stage),
    # and the body is the client's tar, checked to stay inside this folder as it streams.
    tar_under: str = ""

    def target(self, container_id: str = "") -> str:
        path = self.path.replace("{id}", container_id) if self.owner else self.path
        return f"{path}?{self.query}" if self.query else path


@dataclass(frozen=True)
class Refuse:
    reason: str


Decision = Forward | Refuse
Handler = Callable[[Call, Target, re.Match, Settings], Decision]


def flag(value: str) -> str:
    """Docker's reading of a boolean query parameter, as "1" or "0"."""
    return "0" if value.strip().lower() in ("", "0", "no", "false", "none") else "1"


def params(target: Target, allowed: set[str], required: set[str] = frozenset()) -> dict[str, str]:
    unknown = set(target.query) - allowed
    if unknown:
        raise Refused(f"the query parameter {sorted(unknown)[0][:40]!r} is not allowed here")
    missing = required - set(target.query)
    if missing:
        raise Refused(f"the query parameter {sorted(missing)[0]!r} is required")
    return target.query


def no_body(call: Call) -> None:
    if call.body:
        raise Refused("this call takes no body")


def json_body(call: Call) -> bytes:
    media = call.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise Refused("the body must be sent as application/json")
    return call.body


def plain(path: str) -> Handler:
    """A call with neither query nor body (ping, version, info)."""

    def handle(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
        params(target, set())
        no_body(call)
        return Forward(call.method, target.prefix() + path)

    return handle


# --- Images ---------------------------------------------------------------------------------


def image_inspect(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    params(target, set())
    no_body(call)
    ref = checks.check_image(match.group("ref"), settings, "the image")
    return Forward("GET", f"{target.prefix()}/images/{ref}/json")


def image_pull(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    query = params(target, {"fromImage", "tag"}, {"fromImage"})
    no_body(call)
    try:
        ref = pull_reference(query["fromImage"], query.get("tag", ""))
    except TargetError as exc:
        raise Refused(f"fromImage: {exc}") from None
    checks.check_image(str(ref), settings, "fromImage")
    pairs = [("fromImage", ref.name), ("tag", ref.digest or ref.tag)]
    return Forward(
        "POST",
        f"{target.prefix()}/images/create",
        encode_query(pairs),
        registry_auth=call.headers.get("x-registry-auth", ""),
    )


# --- Containers -----------------------------------------------------------------------------


def label_filter(raw: str, settings: Settings) -> str:
    """The ``filters`` of a container list, which must select Tollgate's containers of this
    stack (Docker ANDs label filters), as canonical JSON."""
    try:
        value = parse(raw.encode())
        try:
            filters = dockertypes.FILTERS.element(value, "filters") or {}
        except DecodeError:  # Docker falls back to the legacy form, {"label": ["k=v"]}
            legacy = dockertypes.LEGACY_FILTERS.element(value, "filters") or {}
            filters = {key: dict.fromkeys(values or [], True) for key, values in legacy.items()}
    except DecodeError as exc:
        raise Refused(f"filters: {exc}") from None
    if set(filters) != {"label"}:
        raise Refused("filters: only label filters are allowed")
    labels = sorted(filters["label"] or {})
    for needed in (f"{LABEL_MANAGED}=true", f"{LABEL_STACK}={settings.stack}"):
        if needed not in labels:
            raise Refused(f"filters: a container list must filter on the label {needed}")
    return encode({"label": dict.fromkeys(labels, True)}).decode()


def container_list(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    query = params(target, {"all", "limit", "size", "trunc_cmd", "filters"}, {"filters"})
    no_body(call)
    pairs = [(name, flag(query[name])) for name in ("all", "size") if name in query]
    if "limit" in query:
        if not _INT.fullmatch(query["limit"]):
            raise Refused("limit: not an integer")
        pairs.append(("limit", query["limit"]))
    pairs.append(("filters", label_filter(query["filters"], settings)))
    return Forward("GET", f"{target.prefix()}/containers/json", encode_query(pairs))


def container_create(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    query = params(target, {"name"}, {"name"})
    name = checks.check_container_name(query["name"], settings)
    spec = checks.check_container_create(json_body(call), settings)
    return Forward(
        "POST", f"{target.prefix()}/containers/create", encode_query([("name", name)]), encode(spec)
    )


def container_inspect(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    params(target, set())
    no_body(call)
    return Forward(
        "GET",
        f"{target.prefix()}/containers/{{id}}/json",
        owner=match.group("id"),
        inspect_is_answer=True,
    )


def _action_query(action: str, query: dict[str, str]) -> list[tuple[str, str]]:
    if action == "stop" and "t" in query:
        if not _INT.fullmatch(query["t"]):
            raise Refused("t: not an integer")
        return [("t", query["t"])]
    if action == "kill" and "signal" in query:
        if not _SIGNAL.fullmatch(query["signal"]):
            raise Refused("signal: not a signal name or number")
        return [("signal", query["signal"])]
    if action == "wait" and "condition" in query:
        if query["condition"] not in ("not-running", "next-exit", "removed"):
            raise Refused("condition: not-running, next-exit or removed")
        return [("condition", query["condition"])]
    return []


ACTION_PARAMS = {"start": set(), "stop": {"t"}, "kill": {"signal"}, "wait": {"condition"}}


def container_action(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    action = match.group("action")
    query = params(target, ACTION_PARAMS[action])
    no_body(call)
    return Forward(
        "POST",
        f"{target.prefix()}/containers/{{id}}/{action}",
        encode_query(_action_query(action, query)),
        owner=match.group("id"),
    )


def container_logs(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    query = params(target, {"stdout", "stderr", "timestamps", "follow", "tail", "since", "until"})
    no_body(call)
    pairs = [
        (name, flag(query[name]))
        for name in ("stdout", "stderr", "timestamps", "follow")
        if name in query
    ]
    if "tail" in query:
        if query["tail"] != "all" and not _INT.fullmatch(query["tail"]):
            raise Refused("tail: all or a number of lines")
        pairs.append(("tail", query["tail"]))
    for name in ("since", "until"):
        if name in query:
            if not _TIMESTAMP.fullmatch(query[name]):
                raise Refused(f"{name}: a Unix timestamp")
            pairs.append((name, query[name]))
    return Forward(
        "GET",
        f"{target.prefix()}/containers/{{id}}/logs",
        encode_query(pairs),
        owner=match.group("id"),
    )


def container_remove(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    query = params(target, {"v", "force", "link"})
    no_body(call)
    if flag(query.get("link", "")) == "1":
        raise Refused("link: removing links is not allowed")
    pairs = [(name, flag(query[name])) for name in ("v", "force") if name in query]
    return Forward(
        "DELETE",
        f"{target.prefix()}/containers/{{id}}",
        encode_query(pairs),
        owner=match.group("id"),
    )


# The model cache as helpers mount it (deployments/runtime.cache_mounts), and the one folder
# in it that archives may fill: Tollgate's own copies of uploaded adapters.
CACHE_MOUNT = "/root/.cache/huggingface"
ADAPTER_FOLDER = "tollgate-adapters"
ARCHIVE_PUT = re.compile(rf"(/v[0-9]{{1,3}}\.[0-9]{{1,3}})?/containers/{_ID}/archive")


def streams_body(method: str, raw_target: str) -> bool:
    """Whether the call's body is an archive checked as it streams (not read up front)."""
    return method == "PUT" and bool(ARCHIVE_PUT.fullmatch(raw_target.partition("?")[0]))


def container_archive_put(
    call: Call, target: Target, match: re.Match, settings: Settings
) -> Decision:
    """An uploaded adapter copied into a helper's model cache, and nothing else: the path is
    the cache's mount point and every name in the tar starts with tollgate-adapters/."""
    query = params(target, {"path", "noOverwriteDirNonDir", "copyUIDGID"}, {"path"})
    if query["path"] != CACHE_MOUNT:
        raise Refused(
            f"path: archives may be put only into the model cache ({CACHE_MOUNT}), "
            f"under its {ADAPTER_FOLDER}/ folder"
        )
    if flag(query.get("copyUIDGID", "")) == "1":
        raise Refused("copyUIDGID is not allowed")
    media = call.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in ("", "application/x-tar"):
        raise Refused("the body must be a tar archive (application/x-tar)")
    return Forward(
        "PUT",
        f"{target.prefix()}/containers/{{id}}/archive",
        encode_query([("path", CACHE_MOUNT), ("noOverwriteDirNonDir", "1")]),
        owner=match.group("id"),
        tar_under=ADAPTER_FOLDER,
    )


# --- Networks and volumes -------------------------------------------------------------------


def network_list(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    query = params(target, {"filters"}, {"filters"})
    no_body(call)
    try:
        filters = (
            dockertypes.LEGACY_FILTERS.element(parse(query["filters"].encode()), "filters") or {}
        )
    except DecodeError as exc:
        raise Refused(f"filters: {exc} (a list of names is expected)") from None
    names = filters.get("name") or []
    if set(filters) != {"name"} or not names or not set(names) <= settings.networks:
        raise Refused("filters: only the engine network may be listed, by name")
    return Forward(
        "GET",
        f"{target.prefix()}/networks",
        encode_query([("filters", encode({"name": sorted(names)}).decode())]),
    )


def network_inspect(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    params(target, set())
    no_body(call)
    return Forward(
        "GET",
        f"{target.prefix()}/networks/{{id}}",
        owner=match.group("id"),
        owner_kind="network",
        inspect_is_answer=True,
    )


def network_create(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    params(target, set())
    spec = checks.check_network_create(json_body(call), settings)
    return Forward("POST", f"{target.prefix()}/networks/create", body=encode(spec))


def volume_inspect(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    params(target, set())
    no_body(call)
    if match.group("id") not in settings.volumes:
        raise Refused("only the model and compile cache volumes may be inspected")
    return Forward("GET", f"{target.prefix()}/volumes/{match.group('id')}")


def volume_create(call: Call, target: Target, match: re.Match, settings: Settings) -> Decision:
    params(target, set())
    spec = checks.check_volume_create(json_body(call), settings)
    return Forward("POST", f"{target.prefix()}/volumes/create", body=encode(spec))


ROUTES: list[tuple[frozenset[str], re.Pattern, Handler]] = [
    (frozenset({"GET", "HEAD"}), re.compile(r"/_ping"), plain("/_ping")),
    (frozenset({"GET"}), re.compile(r"/version"), plain("/version")),
    (frozenset({"GET"}), re.compile(r"/info"), plain("/info")),
    (frozenset({"GET"}), re.compile(r"/images/(?P<ref>[^?]+)/json"), image_inspect),
    (frozenset({"POST"}), re.compile(r"/images/create"), image_pull),
    (frozenset({"GET"}), re.compile(r"/containers/json"), container_list),
    (frozenset({"POST"}), re.compile(r"/containers/create"), container_create),
    (frozenset({"GET"}), re.compile(rf"/containers/{_ID}/json"), container_inspect),
    (
        frozenset({"POST"}),
        re.compile(rf"/containers/{_ID}/(?P<action>start|stop|kill|wait)"),
        container_action,
    ),
    (frozenset({"GET"}), re.compile(rf"/containers/{_ID}/logs"), container_logs),
    (frozenset({"PUT"}), re.compile(rf"/containers/{_ID}/archive"), container_archive_put),
    (frozenset({"DELETE"}), re.compile(rf"/containers/{_ID}"), container_remove),
    (frozenset({"GET"}), re.compile(r"/networks"), network_list),
    (frozenset({"POST"}), re.compile(r"/networks/create"), network_create),
    (frozenset({"GET"}), re.compile(rf"/networks/{_ID}"), network_inspect),
    (frozenset({"POST"}), re.compile(r"/volumes/create"), volume_create),
    (frozenset({"GET"}), re.compile(rf"/volumes/{_ID}"), volume_inspect),
]


def decide(call: Call, settings: Settings) -> Decision:
    """The request to forward for ``call``, or why it is refused."""
    if "upgrade" in call.headers:
        return Refuse("connection upgrades (attach, exec, sessions) are not allowed")
    if len(call.body) > MAX_BODY:
        return Refuse(f"the body is larger than {MAX_BODY} bytes")
    try:
        target = parse_target(call.target)
    except TargetError as exc:
        return Refuse(str(exc))
    for methods, pattern, handler in ROUTES:
        match = pattern.fullmatch(target.path)
        if match and call.method in methods:
            try:
                return handler(call, target, match, settings)
            except Refused as exc:
                return Refuse(str(exc))
    return Refuse(f"{call.method} {generic(target.path)} is not a call Tollgate's engines need")


def generic(path: str) -> str:
    """A path with names and ids replaced by placeholders, for refusal messages."""
    parts = path.split("/")
    return "/".join(part if part in _KNOWN_WORDS or not part else "{name}" for part in parts)[:120]


_KNOWN_WORDS = frozenset(
    "_ping version info images containers networks volumes exec plugins swarm services "
    "secrets configs nodes tasks build commit session events system auth distribution json "
    "create start stop kill wait logs attach archive export changes top stats resize update "
    "rename pause unpause restart prune load get push tag search history connect disconnect "
    "pull enable disable upgrade set privileges df grpc".split()
)
