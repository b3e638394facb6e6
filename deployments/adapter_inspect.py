"""Run by deployments/adapters.py inside a helper container (``python3 -c``, stdlib only):
inspect a LoRA adapter and its base model in the mounted model cache and print one line of
JSON: the adapter's files and size, its PEFT type, rank and target modules, and which of
those modules the base's weights lack.

argv: the adapter's source and the base's source (each a hub id staged in the cache or an
absolute folder in it). Nothing is imported from the adapter: its config is read as JSON,
the base's module names from its safetensors headers (a length and a JSON header).
"""

import json
import os
import re
import struct
import sys

CACHE = "/root/.cache/huggingface"


def folder(source):
    if source.startswith("/"):
        return os.path.realpath(source)
    repo = os.path.join(CACHE, "hub", "models--" + source.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main")) as fh:
            return os.path.join(repo, "snapshots", fh.read().strip())
    except OSError:
        return None


def files_of(path):
    found, size = [], 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            found.append(os.path.relpath(full, path))
            size += os.path.getsize(full)
    return sorted(found), size


def base_modules(path):
    """Full module names of the base's weights (``model.layers.0.self_attn.q_proj``)."""
    names = set()
    for rel in files_of(path)[0]:
        if not rel.endswith(".safetensors"):
            continue
        with open(os.path.join(path, rel), "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 100_000_000:
                continue
            header = json.loads(fh.read(length))
        names.update(k.rsplit(".", 1)[0] for k in header if k != "__metadata__")
    return names


def missing(targets, modules):
    if not modules:
        return []
    if isinstance(targets, str):  # PEFT: a regex over full module names
        return [] if any(re.fullmatch(targets, m) for m in modules) else [targets]
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    return [t for t in targets or [] if t not in leaves and t not in modules]


def main():
    adapter, base = sys.argv[1], sys.argv[2]
    path = folder(adapter)
    if not path or not os.path.isdir(path):
        return {"error": f"No adapter found at {adapter} in the model cache (stage it first)."}
    try:
        with open(os.path.join(path, "adapter_config.json")) as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        return {"error": f"adapter_config.json is missing or unreadable: {exc}"}
    files, size = files_of(path)
    base_path = folder(base)
    modules = base_modules(base_path) if base_path and os.path.isdir(base_path) else set()
    targets = config.get("target_modules")
    return {
        "files": files,
        "size_bytes": size,
        "peft_type": config.get("peft_type"),
        "rank": config.get("r"),
        "target_modules": targets if isinstance(targets, list) else [targets] if targets else [],
        "base_model": config.get("base_model_name_or_path"),
        "missing_modules": missing(targets, modules),
    }


print(json.dumps(main()))
