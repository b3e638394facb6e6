"""Rewrites the platform recorded in a `docker save` stream: stdin to stdout.

    docker save IMAGE | python3 set-platform.py linux/arm64 | docker load

Docker 20.10's classic builder (no BuildKit here) cannot build for another platform: with
`--platform` it refuses its own layers after a metadata-only step (WORKDIR), without it it
records the host's platform on an image whose binaries are another architecture's. The
layers are right, only the image configuration's `os`/`architecture` are not: this sets
them, renames the configuration after its new digest and points manifest.json at it.
"""

import hashlib
import io
import json
import sys
import tarfile


def main() -> None:
    os_name, _, arch = sys.argv[1].partition("/")
    held: dict[str, bytes] = {}
    with (
        tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as src,
        tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as dst,
    ):
        for member in src:
            # The small top-level JSON files wait for the end; layers stream through.
            if member.isfile() and "/" not in member.name and member.name.endswith(".json"):
                held[member.name] = src.extractfile(member).read()
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        manifest = json.loads(held.pop("manifest.json"))
        for entry in manifest:
            config = json.loads(held.pop(entry["Config"]))
            config["os"], config["architecture"] = os_name, arch
            data = json.dumps(config, separators=(",", ":")).encode()
            entry["Config"] = hashlib.sha256(data).hexdigest() + ".json"
            held[entry["Config"]] = data
        held["manifest.json"] = json.dumps(manifest).encode()
        for name, data in held.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            dst.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
