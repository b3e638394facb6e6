"""``tarstream.checked_tar``: the tar of an archive put, checked header by header as it streams
to Docker and rebuilt; what passes comes out as Docker will extract it, and every other kind
of entry stops the stream before it reaches Docker."""

from __future__ import annotations

import asyncio
import io
import tarfile

import pytest

from dockerpolicy.tarstream import TarRefused, checked_tar

UNDER = "tollgate-adapters"


def entry(name: str, data: bytes = b"", **fields: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data


def tar_of(*entries: tuple[tarfile.TarInfo, bytes], format: int = tarfile.USTAR_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=format) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buffer.getvalue()


def run(data: bytes, step: int = 700) -> bytes:
    """What Docker receives, the client's tar arriving ``step`` bytes at a time."""
    stream = io.BytesIO(data)

    async def read(n: int) -> bytes:
        return stream.read(min(n, step))

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in checked_tar(read, UNDER)])

    return asyncio.run(collect())


def test_files_and_folders_pass_rebuilt_with_safe_owners_and_modes() -> None:
    weights = bytes(range(256)) * 9  # not a multiple of the block size
    sent = tar_of(
        entry(UNDER, type=tarfile.DIRTYPE, mode=0o777, uid=1000, uname="me"),
        entry(f"{UNDER}/acme-1a", type=tarfile.DIRTYPE, mode=0o1777),
        entry(f"{UNDER}/acme-1a/adapter_config.json", b'{"r": 8}', mode=0o4755, uid=7),
        entry(f"{UNDER}/acme-1a/adapter_model.safetensors", weights, mode=0o666),
    )
    received = run(sent)
    with tarfile.open(fileobj=io.BytesIO(received)) as tar:
        members = tar.getmembers()
        contents = {m.name: tar.extractfile(m).read() for m in members if m.isfile()}
    assert [(m.name, m.mode, m.uid, m.gid, m.uname) for m in members] == [
        (UNDER, 0o755, 0, 0, ""),
        (f"{UNDER}/acme-1a", 0o755, 0, 0, ""),
        (f"{UNDER}/acme-1a/adapter_config.json", 0o644, 0, 0, ""),
        (f"{UNDER}/acme-1a/adapter_model.safetensors", 0o644, 0, 0, ""),
    ]
    assert contents[f"{UNDER}/acme-1a/adapter_model.safetensors"] == weights


def test_nothing_after_the_end_of_the_archive_is_forwarded() -> None:
    sent = tar_of(entry(f"{UNDER}/a/x.safetensors", b"w")) + b"trailing garbage" * 100
    assert run(sent).endswith(bytes(1024)) and b"garbage" not in run(sent)


def bad_checksum() -> bytes:
    data = bytearray(tar_of(entry(f"{UNDER}/a/x.safetensors", b"w")))
    data[0:1] = b"T"  # the name changes, the checksum does not
    return bytes(data)


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        (tar_of(entry("hub/models--x/snapshots/a/model.safetensors", b"w")), "not a plain"),
        (tar_of(entry("elsewhere/a/x.safetensors", b"w")), "is outside tollgate-adapters/"),
        (tar_of(entry(f"{UNDER}/../x", b"w")), "has a dot part"),
        (tar_of(entry(f"/{UNDER}/a/x", b"w")), "not a plain relative path"),
        (tar_of(entry(f"{UNDER}/a/b/c", b"w")), "not a plain relative path"),
        (tar_of(entry(f"{UNDER}/a b/x", b"w")), "not a plain relative path"),
        (tar_of(entry(f"{UNDER}/a/x", type=tarfile.SYMTYPE, linkname="/etc")), "no links"),
        (tar_of(entry(f"{UNDER}/a/x", type=tarfile.LNKTYPE, linkname="etc/passwd")), "no links"),
        (tar_of(entry(f"{UNDER}/a/x", type=tarfile.CHRTYPE)), "no links, devices"),
        (tar_of(entry(f"{UNDER}/a/x", type=tarfile.FIFOTYPE)), "FIFOs"),
        (
            tar_of(
                entry(f"{UNDER}/a/x", b"w", pax_headers={"path": "/etc/x"}),
                format=tarfile.PAX_FORMAT,
            ),
            "extension headers",
        ),
        (tar_of(entry(f"{UNDER}/a/x", b"w"), format=tarfile.GNU_FORMAT), "only POSIX ustar"),
        (bad_checksum(), "checksum is wrong"),
        (tar_of(entry(f"{UNDER}/a/x", b"w" * 2000))[:1500], "ends in the middle"),
    ],
)
def test_anything_else_stops_the_stream_with_its_reason(sent: bytes, why: str) -> None:
    with pytest.raises(TarRefused, match=why.replace("(", r"\(")):
        run(sent)


def test_a_bad_entry_after_good_ones_is_never_forwarded() -> None:
    sent = tar_of(
        entry(f"{UNDER}/a/adapter_config.json", b"{}"),
        entry(f"{UNDER}/a/evil", type=tarfile.SYMTYPE, linkname="/"),
    )
    forwarded = []
    stream = io.BytesIO(sent)

    async def read(n: int) -> bytes:
        return stream.read(n)

    async def collect() -> None:
        async for chunk in checked_tar(read, UNDER):
            forwarded.append(chunk)

    with pytest.raises(TarRefused):
        asyncio.run(collect())
    assert b"evil" not in b"".join(forwarded) and b"adapter_config.json" in forwarded[0]
