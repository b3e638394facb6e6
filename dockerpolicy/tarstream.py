"""The tar stream of an archive upload (``PUT /containers/{id}/archive``), checked and rebuilt
as it passes, never held whole.

The archive API is how the worker puts an uploaded LoRA adapter into a node's model cache.
Docker extracts whatever tar it gets, so the policy lets through only what that needs:
POSIX ustar headers of regular files and directories, every name a plain relative path
inside one folder (``tollgate-adapters/``) of at most three parts, each part letters,
digits, ``.``, ``_`` and ``-``. Links, devices, FIFOs, PAX and GNU extension headers,
sparse files, numbers in base-256 and a bad checksum are refused. Each header Docker
receives is rebuilt from the checked fields (owner root, mode 0644 for files and 0755 for
folders, no set-id bits); file contents pass through unchanged. A refusal cuts the upload
off before the offending header reaches Docker.
"""

import re
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable

BLOCK = 512
CHUNK = 256 * 1024
MAX_PARTS = 3  # tollgate-adapters/<folder>/<file>
_PART = re.compile(r"[A-Za-z0-9._-]{1,100}", re.ASCII)
_OCTAL = re.compile(rb"[0-7]{0,12}", re.ASCII)
REGULAR, DIRECTORY = (b"0", b"\0"), b"5"


class TarRefused(Exception):
    """The stream holds something the policy does not pass; the message says what."""


Read = Callable[[int], Awaitable[bytes]]


async def read_exactly(read: Read, size: int) -> bytes:
    """``size`` bytes of the stream; refused when it ends before."""
    data = b""
    while len(data) < size:
        chunk = await read(size - len(data))
        if not chunk:
            raise TarRefused("the archive ends in the middle of an entry")
        data += chunk
    return data


def _number(field: bytes, what: str) -> int:
    digits = field.rstrip(b"\0 ").lstrip(b" ")
    if not _OCTAL.fullmatch(digits):
        raise TarRefused(f"the {what} of an entry is not an octal number")
    return int(digits or b"0", 8)


def checked_name(raw: str, under: str) -> str:
    """The entry's name if it is a plain relative path inside ``under``."""
    name = raw[:-1] if raw.endswith("/") else raw
    parts = name.split("/")
    if len(parts) > MAX_PARTS or not all(_PART.fullmatch(p) for p in parts):
        raise TarRefused(f"the name {raw[:120]!r} is not a plain relative path")
    if {".", ".."} & set(parts):
        raise TarRefused(f"the name {raw[:120]!r} has a dot part")
    if parts[0] != under:
        raise TarRefused(f"the name {raw[:120]!r} is outside {under}/")
    return name


def parse_header(block: bytes, under: str) -> tarfile.TarInfo:
    """The checked entry a header block describes, as the rebuilt header will say it."""
    stored = _number(block[148:156], "checksum")
    if stored != sum(block[:148]) + 8 * 0x20 + sum(block[156:]):
        raise TarRefused("an entry's header checksum is wrong")
    if block[257:265] != b"ustar\x0000":
        raise TarRefused("only POSIX ustar headers are allowed (no GNU or old-style tar)")
    kind = block[156:157]
    if kind not in (*REGULAR, DIRECTORY):
        raise TarRefused(
            f"entry type {kind!r}: only regular files and folders are allowed "
            "(no links, devices, FIFOs or extension headers)"
        )
    try:
        name = block[0:100].split(b"\0", 1)[0].decode("ascii")
        prefix = block[345:500].split(b"\0", 1)[0].decode("ascii")
        link = block[157:257].split(b"\0", 1)[0]
    except UnicodeDecodeError:
        raise TarRefused("an entry's name is not ASCII") from None
    if link:
        raise TarRefused("an entry names a link target")
    info = tarfile.TarInfo(checked_name(f"{prefix}/{name}" if prefix else name, under))
    info.mtime = _number(block[136:148], "mtime")
    if kind == DIRECTORY:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    else:
        info.type, info.mode, info.size = tarfile.REGTYPE, 0o644, _number(block[124:136], "size")
    return info


def rebuilt(info: tarfile.TarInfo) -> bytes:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    try:
        return info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")
    except ValueError as exc:  # a number too large for its field
        raise TarRefused(f"an entry cannot be rebuilt: {exc}") from None


async def checked_tar(read: Read, under: str) -> AsyncIterator[bytes]:
    """The archive Docker receives: each header checked and rebuilt, contents unchanged,
    then the end-of-archive blocks (anything after them is not forwarded)."""
    while True:
        block = await read_exactly(read, BLOCK)
        if block == bytes(BLOCK):
            yield bytes(2 * BLOCK)
            return
        info = parse_header(block, under)
        yield rebuilt(info)
        left = info.size + (-info.size % BLOCK)
        while left:
            chunk = await read(min(left, CHUNK))
            if not chunk:
                raise TarRefused("the archive ends in the middle of a file")
            left -= len(chunk)
            yield chunk
