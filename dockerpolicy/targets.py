"""Request targets and image references, parsed strictly and rebuilt canonically.

A target is refused rather than interpreted when two readers could disagree about it:
percent-encoding or any character Docker paths never need, empty or dot segments, a
repeated query parameter (Go's ``Form.Get`` takes the first, other parsers the last),
semicolons (old Go split on them), malformed escapes. What is forwarded is rebuilt from
the parsed parts.
"""

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote_plus, urlencode

# Container and volume names, ids and image references use only these.
_PATH_CHARS = re.compile(r"[A-Za-z0-9._:@/-]*", re.ASCII)
_VERSION = re.compile(r"/v([0-9]{1,3})\.([0-9]{1,3})(/.*)", re.ASCII)
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
MIN_API_MINOR = 24  # the Docker SDK's minimum; older versions took a HostConfig on start


class TargetError(ValueError):
    """The request target is one the policy will not interpret."""


@dataclass(frozen=True)
class Target:
    """A parsed request target: API version ("" when unversioned), path, query."""

    version: str
    path: str
    query: dict[str, str]

    def prefix(self) -> str:
        return f"/v{self.version}" if self.version else ""


def parse_target(raw: str) -> Target:
    if not raw.startswith("/"):
        raise TargetError("the request target must be an absolute path")
    if "#" in raw:
        raise TargetError("the request target has a fragment")
    path, has_query, query = raw.partition("?")
    if not _PATH_CHARS.fullmatch(path):
        raise TargetError(
            "the path holds characters no Docker path needs (percent-encoding, spaces, ...)"
        )
    segments = path.split("/")[1:]
    if "" in segments:
        raise TargetError("the path has an empty segment (// or a trailing /)")
    if "." in segments or ".." in segments:
        raise TargetError("the path has a dot segment")
    version = ""
    match = _VERSION.fullmatch(path)
    if match:
        major, minor = int(match.group(1)), int(match.group(2))
        if major != 1 or minor < MIN_API_MINOR:
            raise TargetError(
                f"API version {major}.{minor} is not supported (1.{MIN_API_MINOR} or newer)"
            )
        version, path = f"1.{minor}", match.group(3)
    return Target(version, path, parse_query(query) if has_query else {})


def _unescape(text: str) -> str:
    if _BAD_ESCAPE.search(text):
        raise TargetError("the query has a malformed percent-escape")
    try:
        return unquote_plus(text, errors="strict")
    except UnicodeDecodeError:
        raise TargetError("the query is not UTF-8") from None


def parse_query(query: str) -> dict[str, str]:
    if query == "":
        return {}
    if ";" in query:
        raise TargetError("the query has a semicolon")
    out: dict[str, str] = {}
    for part in query.split("&"):
        if part == "":
            raise TargetError("the query has an empty parameter")
        key, _, value = part.partition("=")
        key, value = _unescape(key), _unescape(value)
        if key in out:
            raise TargetError(f"the query parameter {key[:40]!r} is given more than once")
        out[key] = value
    return out


def encode_query(pairs: list[tuple[str, str]]) -> str:
    return urlencode(pairs, quote_via=quote, safe="")


# --- Image references (Docker's distribution/reference grammar) ------------------------------

_ALNUM = r"[a-z0-9]+"
_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(
    rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?", re.ASCII
)
_TAG_ONLY = re.compile(_TAG, re.ASCII)
_DIGEST_ONLY = re.compile(_DIGEST, re.ASCII)


@dataclass(frozen=True)
class ImageRef:
    """An image reference: repository name, optional tag, optional digest."""

    name: str
    tag: str
    digest: str

    def __str__(self) -> str:
        return (
            self.name
            + (f":{self.tag}" if self.tag else "")
            + (f"@{self.digest}" if self.digest else "")
        )


def parse_image(text: str) -> ImageRef:
    match = _REFERENCE.fullmatch(text)
    if not match or len(match.group("name")) > 255:
        raise TargetError(f"{text[:80]!r} is not a valid image reference")
    return ImageRef(match.group("name"), match.group("tag") or "", match.group("digest") or "")


def pull_reference(from_image: str, tag: str) -> ImageRef:
    """The image ``POST /images/create?fromImage=…&tag=…`` pulls, as Docker combines them
    (a ``tag`` that parses as a digest is one)."""
    ref = parse_image(from_image)
    if tag:
        if ref.tag or ref.digest:
            raise TargetError("the tag is given both in fromImage and in tag")
        if _DIGEST_ONLY.fullmatch(tag):
            return ImageRef(ref.name, "", tag)
        if not _TAG_ONLY.fullmatch(tag):
            raise TargetError(f"{tag[:80]!r} is not a valid tag")
        return ImageRef(ref.name, tag, "")
    if not (ref.tag or ref.digest):
        raise TargetError("a pull needs a tag or a digest (a bare name pulls every tag)")
    return ref
