"""The check of an uploaded adapter archive before Tollgate accepts it: what passes, how it
is normalised, and each refusal with the reason the admin reads."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from deployments.adapter_archives import accept

CONFIG = json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}).encode()


def weights() -> bytes:
    """A tiny valid safetensors file (an 8-byte header length, a JSON header, the data)."""
    header = json.dumps({"x.lora_A.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    return len(header).to_bytes(8, "little") + header.encode() + b"\0" * 4


GOOD = {"adapter_config.json": CONFIG, "adapter_model.safetensors": weights(), "README.md": b"hi"}


def make_tar(files: dict[str, bytes], compress: bool = False, **special: str) -> bytes:
    """A tar of ``files``; ``special`` adds entries by name: "symlink", "hardlink", "fifo",
    "chardev" or "dir"."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if compress else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        kinds = {
            "symlink": tarfile.SYMTYPE,
            "hardlink": tarfile.LNKTYPE,
            "fifo": tarfile.FIFOTYPE,
            "chardev": tarfile.CHRTYPE,
            "dir": tarfile.DIRTYPE,
        }
        for name, kind in special.items():
            info = tarfile.TarInfo(name)
            info.type = kinds[kind]
            info.linkname = "/etc/passwd" if kind in ("symlink", "hardlink") else ""
            tar.addfile(info)
    return buffer.getvalue()


def make_zip(files: dict[str, bytes], modes: dict[str, int] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (modes or {}).get(name, 0o100644) << 16
            archive.writestr(info, data)
    return buffer.getvalue()


def check(data: bytes, out: Path) -> object:
    return accept(io.BytesIO(data), len(data), "acme--support-1a2b", out / "a.tar")


def names_in(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {
            m.name: (tar.extractfile(m).read() if m.isfile() else b"")
            for m in tar.getmembers()
            if m.isfile()
        }


@pytest.mark.parametrize(
    "archive",
    [
        make_tar(GOOD),
        make_tar(GOOD, compress=True),
        make_zip(GOOD),
        # One folder around everything, as `tar czf a.tgz my-adapter/` makes, and Finder's junk.
        make_tar({f"my adapter/{n}": d for n, d in GOOD.items()}, compress=True),
        make_zip({**{f"my-adapter/{n}": d for n, d in GOOD.items()}, "__MACOSX/._x": b"j"}),
        make_tar({f"./{n}": d for n, d in GOOD.items()}),
    ],
    ids=["tar", "tar.gz", "zip", "tar.gz in a folder", "zip in a folder with junk", "./ names"],
)
def test_an_adapter_archive_is_accepted_as_a_normalised_tar(archive: bytes, tmp_path: Path) -> None:
    accepted = check(archive, tmp_path)
    assert accepted.rank == 8
    assert accepted.files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert accepted.size_bytes == sum(len(d) for d in GOOD.values())
    folder = "tollgate-adapters/acme--support-1a2b"
    assert names_in(accepted.path) == {f"{folder}/{n}": d for n, d in GOOD.items()}
    with tarfile.open(accepted.path) as tar:
        members = tar.getmembers()
    assert [m.name for m in members if m.isdir()] == ["tollgate-adapters", folder]
    assert all(m.uid == 0 and m.mode in (0o644, 0o755) for m in members)
    assert list(tmp_path.iterdir()) == [tmp_path / "a.tar"]  # no partial file left


NO_CONFIG = {k: v for k, v in GOOD.items() if k != "adapter_config.json"}
NO_WEIGHTS = {k: v for k, v in GOOD.items() if k != "adapter_model.safetensors"}


@pytest.mark.parametrize(
    ("archive", "reason"),
    [
        (b"just some text, not an archive" * 30, "Upload a .tar, .tar.gz or .zip archive"),
        (gzip.compress(b"not a tar inside" * 100, mtime=0), "The archive cannot be read"),
        (make_tar({**GOOD, "/etc/cron.d/x": b"x"}), "/etc/cron.d/x: absolute paths"),
        (make_tar({**GOOD, "../../x.safetensors": b"x"}), "must not climb out of the archive"),
        (make_zip({**GOOD, "a/../../x.safetensors": b"x"}), "must not climb out of the archive"),
        (make_zip({**GOOD, "..\\x.safetensors": b"x"}), "backslashes"),
        (make_tar(GOOD, link="symlink"), "link: links, devices, pipes"),
        (make_tar(GOOD, hard="hardlink"), "hard: links, devices, pipes"),
        (make_tar(GOOD, pipe="fifo"), "pipe: links, devices, pipes"),
        (make_tar(GOOD, dev="chardev"), "dev: links, devices, pipes"),
        (make_zip({**GOOD, "ln": b"/etc/passwd"}, {"ln": 0o120777}), "ln: links, devices"),
        (make_tar({**GOOD, "adapter_model.bin": b"pickle"}), "adapter_model.bin: only"),
        (make_zip({**GOOD, "handler.py": b"import os"}), "handler.py: only"),
        (make_tar({**GOOD, "sub/extra.safetensors": weights()}), "not in sub-folders"),
        (make_tar(NO_CONFIG), "No adapter_config.json in the archive"),
        (make_zip(NO_WEIGHTS), "No adapter weights (*.safetensors)"),
        (make_tar({**GOOD, "adapter_config.json": b"{nope"}), "is not valid JSON"),
        (
            make_tar({**GOOD, "adapter_config.json": b'{"peft_type": "IA3", "r": 8}'}),
            "peft_type 'IA3'; only LoRA adapters",
        ),
        (make_zip({**GOOD, "adapter_config.json": b'{"peft_type": "LORA"}'}), "gives no rank"),
        (make_tar({"a/adapter_config.json": CONFIG, **GOOD}), "not in sub-folders"),
    ],
)
def test_an_unsafe_or_wrong_archive_is_refused_with_its_reason(
    archive: bytes, reason: str, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError) as refused:
        check(archive, tmp_path)
    (message,) = refused.value.message_dict["archive"]
    assert reason in message
    assert list(tmp_path.iterdir()) == []  # nothing kept


def test_a_file_in_an_archive_twice_is_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in [*GOOD.items(), ("adapter_model.safetensors", weights())]:
            archive.writestr(name, data)
    with pytest.raises(ValidationError, match="adapter_model.safetensors is in the archive twice"):
        check(buffer.getvalue(), tmp_path)


def test_sizes_packed_and_unpacked_are_held_to_the_limit(settings: object, tmp_path: Path) -> None:
    settings.TOLLGATE_ADAPTER_MAX_BYTES = 10_000
    big = make_tar({**GOOD, "adapter_model.safetensors": weights() + b"\0" * 20_000})
    with pytest.raises(ValidationError, match=r"The archive takes 0\.00 GB"):
        check(big, tmp_path)
    # A small .tar.gz that unpacks beyond the limit (a bomb) stops at the listing.
    bomb = make_tar({**GOOD, "adapter_model.safetensors": b"\0" * 5_000_000}, compress=True)
    assert len(bomb) < 10_000
    with pytest.raises(ValidationError, match="Unpacked, the adapter takes"):
        check(bomb, tmp_path)
    assert list(tmp_path.iterdir()) == []
