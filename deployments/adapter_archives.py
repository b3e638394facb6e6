"""The check of an uploaded adapter archive (.tar, .tar.gz or .zip), in the web process,
before Tollgate accepts it; and its normalised form, the tar the worker copies into nodes'
model caches.

Read as a stream from the uploaded file (on disk once it is large), never whole in memory:
a first pass lists the members, a second writes the normalised tar. Refused, each with its
reason: an archive over TOLLGATE_ADAPTER_MAX_BYTES packed or unpacked; names that are
absolute, climb out (``..``) or are otherwise unsafe; links, devices, FIFOs and other
special files; files in sub-folders; any file but ``adapter_config.json``, ``*.safetensors``
and the harmless text files an adapter folder holds (README.md …); an
``adapter_config.json`` that is unreadable, not PEFT's LoRA or gives no rank. One folder
around everything (``my-adapter/adapter_config.json``) is taken off; macOS metadata
(``__MACOSX/``, ``._*``, ``.DS_Store``) is dropped.
"""

from __future__ import annotations

import io
import json
import re
import stat
import tarfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from django.conf import settings
from django.core.exceptions import ValidationError

from deployments.adapters import HARMLESS

CONFIG = "adapter_config.json"
CONFIG_MAX_BYTES = 1024 * 1024
# The folder of the model cache that holds Tollgate's copies of uploaded adapters; every
# name in a normalised tar starts with it (the Docker API policy allows nothing else).
UPLOADS_FOLDER = "tollgate-adapters"
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}", re.ASCII)
_UNSAFE_CHARS = re.compile(r"[\x00-\x1f\\:]")
KINDS = "a .tar, .tar.gz or .zip archive"


def refuse(message: str) -> ValidationError:
    return ValidationError({"archive": message})


@dataclass(frozen=True)
class Member:
    """A file of the archive: its name there, its name in the adapter folder, its size."""

    name: str
    final: str
    size: int


@dataclass(frozen=True)
class Accepted:
    """An archive accepted: its normalised tar and what it holds."""

    path: Path
    files: list[str]
    size_bytes: int
    rank: int


def gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


def limit() -> int:
    return settings.TOLLGATE_ADAPTER_MAX_BYTES


def check_packed_size(size: int) -> None:
    if size > limit():
        raise refuse(
            f"The archive takes {gb(size)}; an adapter may take at most {gb(limit())} "
            "(TOLLGATE_ADAPTER_MAX_BYTES)."
        )


def kind_of(upload: IO[bytes]) -> str:
    """zip, gz or tar, from the file's first bytes (not its name)."""
    upload.seek(0)
    head = upload.read(512)
    upload.seek(0)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:2] == b"\x1f\x8b":
        return "gz"
    if len(head) == 512 and head[257:262] == b"ustar":
        return "tar"
    raise refuse(f"Upload {KINDS}; this file is none of them.")


# --- Names ------------------------------------------------------------------------------


def _parts(name: str) -> list[str]:
    """The parts of a member's name; refused when the name is unsafe. [] for the top itself."""
    while name.startswith("./"):
        name = name[2:]
    if name in ("", "."):
        return []
    if name.startswith("/"):
        raise refuse(f"{name[:120]}: absolute paths are not allowed in the archive.")
    if _UNSAFE_CHARS.search(name):
        raise refuse(
            f"{name[:120]!r}: names with backslashes, colons or control characters are not allowed."
        )
    parts = name.rstrip("/").split("/")
    if ".." in parts:
        raise refuse(f"{name[:120]}: names must not climb out of the archive (..).")
    if "" in parts or "." in parts:
        raise refuse(f"{name[:120]}: not a plain relative path.")
    return parts


def _junk(parts: list[str]) -> bool:
    """macOS metadata a zip made in Finder carries: dropped, never copied."""
    return parts[0] == "__MACOSX" or parts[-1] == ".DS_Store" or parts[-1].startswith("._")


def _allowed(name: str) -> bool:
    return name.endswith(".safetensors") or name in HARMLESS


def plan(entries: list[tuple[str, bool, int]]) -> list[Member]:
    """The archive's files under their names in the adapter folder. ``entries``: (name,
    is a folder, size) as listed. One folder around everything is taken off."""
    files = []
    for name, folder, size in entries:
        parts = _parts(name)
        if parts and not folder and not _junk(parts):
            files.append((name, parts, size))
    tops = {parts[0] for _, parts, _ in files}
    strip = len(tops) == 1 and all(len(parts) > 1 for _, parts, _ in files)
    members, seen = [], set()
    for name, parts, size in files:
        rest = parts[1:] if strip else parts
        if len(rest) != 1:
            raise refuse(
                f"{name[:120]}: put the adapter's files at the archive's top level "
                "(or in one folder), not in sub-folders."
            )
        final = rest[0]
        if not _allowed(final) or not _SAFE_NAME.fullmatch(final):
            raise refuse(
                f"{name[:120]}: only {CONFIG}, *.safetensors weights and "
                f"{', '.join(sorted(HARMLESS - {CONFIG}))} are accepted."
            )
        if final in seen:
            raise refuse(f"{final} is in the archive twice.")
        seen.add(final)
        members.append(Member(name, final, size))
    _check_contents(members)
    return members


def _check_contents(members: list[Member]) -> None:
    names = {m.final for m in members}
    if CONFIG not in names:
        raise refuse(f"No {CONFIG} in the archive: PEFT writes it beside the weights.")
    if not any(n.endswith(".safetensors") for n in names):
        raise refuse("No adapter weights (*.safetensors) in the archive.")
    total = sum(m.size for m in members)
    if total > limit():
        raise _unpacked_too_large(total)


def rank_of(data: bytes) -> int:
    """The rank adapter_config.json gives; refused unless it is PEFT's LoRA with a rank."""
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise refuse(f"{CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG} is not a JSON object.")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise refuse(f"{CONFIG} gives peft_type {peft_type!r}; only LoRA adapters are served.")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"{CONFIG} gives no rank (r).")
    return rank


# --- Reading each kind ----------------------------------------------------------------------


def _special(what: str) -> ValidationError:
    return refuse(f"{what}: links, devices, pipes and other special files are not allowed.")


def _unpacked_too_large(total: int) -> ValidationError:
    return refuse(
        f"Unpacked, the adapter takes {gb(total)}; it may take at most {gb(limit())} "
        "(TOLLGATE_ADAPTER_MAX_BYTES)."
    )


def list_tar(upload: IO[bytes], compressed: bool) -> list[tuple[str, bool, int]]:
    entries, total = [], 0
    with _reading(), tarfile.open(fileobj=upload, mode="r|gz" if compressed else "r|") as tar:
        for info in tar:
            if not (info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) or info.isdir()):
                raise _special(info.name[:120])
            total += info.size
            if total > limit():  # before a bomb is inflated any further
                raise _unpacked_too_large(total)
            entries.append((info.name, info.isdir(), info.size))
    return entries


def list_zip(upload: IO[bytes]) -> list[tuple[str, bool, int]]:
    entries = []
    with _reading(), zipfile.ZipFile(upload) as archive:
        for info in archive.infolist():
            kind = stat.S_IFMT(info.external_attr >> 16)  # 0: made where files have no kind
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise _special(info.filename[:120])
            if info.flag_bits & 0x1:
                raise refuse(f"{info.filename[:120]} is encrypted; upload it unencrypted.")
            entries.append((info.filename, info.is_dir(), info.file_size))
    return entries


@contextmanager
def _reading() -> Iterator[None]:
    try:
        yield
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise refuse(f"The archive cannot be read: {exc}") from None


def _sources(upload: IO[bytes], kind: str) -> Iterator[tuple[str, IO[bytes]]]:
    """Each file's name in the archive and a stream of its contents, in archive order."""
    upload.seek(0)
    if kind == "zip":
        with zipfile.ZipFile(upload) as archive:
            for info in archive.infolist():
                if not info.is_dir():
                    with archive.open(info) as data:
                        yield info.filename, data
        return
    with tarfile.open(fileobj=upload, mode="r|gz" if kind == "gz" else "r|") as tar:
        for info in tar:
            if info.isfile():
                yield info.name, tar.extractfile(info)


# --- The normalised tar ---------------------------------------------------------------------


def accept(upload: IO[bytes], size: int, folder: str, out: Path) -> Accepted:
    """Check an uploaded archive and write it to ``out`` as a tar whose names are
    ``tollgate-adapters/<folder>/<file>``; refused with the reason (a ValidationError on
    ``archive``), leaving nothing behind."""
    check_packed_size(size)
    kind = kind_of(upload)
    upload.seek(0)
    listed = list_zip(upload) if kind == "zip" else list_tar(upload, kind == "gz")
    members = {m.name: m for m in plan(listed)}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".part")
    try:
        with _reading(), tarfile.open(partial, "w", format=tarfile.USTAR_FORMAT) as tar:
            _add_folder(tar, UPLOADS_FOLDER)
            _add_folder(tar, f"{UPLOADS_FOLDER}/{folder}")
            rank = _copy(tar, _sources(upload, kind), members, folder)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    files = sorted(m.final for m in members.values())
    return Accepted(out, files, sum(m.size for m in members.values()), rank)


def _copy(
    tar: tarfile.TarFile, sources: Iterator[tuple[str, IO[bytes]]], members: dict, folder: str
) -> int:
    rank = 0
    for name, data in sources:
        member = members.get(name)
        if member is None:  # dropped (macOS metadata)
            continue
        info = _file_info(f"{UPLOADS_FOLDER}/{folder}/{member.final}", member.size)
        if member.final == CONFIG:
            if member.size > CONFIG_MAX_BYTES:
                raise refuse(f"{CONFIG} is larger than {CONFIG_MAX_BYTES // 1024} KiB.")
            config = data.read(CONFIG_MAX_BYTES + 1)
            rank = rank_of(config)
            data = io.BytesIO(config)
        tar.addfile(info, data)
    return rank


def _file_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, int(time.time())
    return info


def _add_folder(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
    tar.addfile(info)
