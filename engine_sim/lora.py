"""LoRA adapters, as vLLM serves them beside its base model.

Named at start (``--enable-lora --lora-modules name=path``) or loaded and unloaded at run
time (``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, routes that exist only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true). A request names an adapter as its
``model``; the simulator's answer then differs from the base's (its reply plan is seeded
with the adapter's name too). Paths resolve as vLLM resolves them: a local folder, or a hub
repository id found in the Hugging Face cache (``$HF_HOME/hub``). An adapter's rank is read
from its ``adapter_config.json``; above ``--max-lora-rank`` the load fails as vLLM's worker
fails it. Answers and errors are vLLM 0.32's, word for word (tests/vllm/test_adapters.py
holds the real engine to them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine_sim.errors import ApiError, missing_field

# vLLM's --max-lora-rank choices.
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def parse_modules(values: list[str]) -> dict[str, str]:
    """``--lora-modules`` entries: ``name=path`` or vLLM's JSON form ``{"name", "path"}``."""
    modules: dict[str, str] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            spec = json.loads(value)
            modules[str(spec["name"])] = str(spec["path"])
        else:
            name, _, path = value.partition("=")
            modules[name] = path
    return modules


def hub_cache() -> Path:
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache/huggingface")
    return Path(os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"))


def resolve(path: str) -> Path | None:
    """The adapter's folder: ``path`` itself, or the cached snapshot of hub repository
    ``path``; None when neither holds an ``adapter_config.json``."""
    local = Path(path)
    if local.is_absolute() or path.startswith("."):
        return local if (local / "adapter_config.json").is_file() else None
    repo = hub_cache() / f"models--{path.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text(encoding="ascii").strip()
    except OSError:
        return None
    folder = repo / "snapshots" / revision
    return folder if (folder / "adapter_config.json").is_file() else None


def rank_of(folder: Path) -> int:
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    return int(config.get("r", 8))


class Adapters:
    """The adapters an engine serves: served name -> the path it was given."""

    def __init__(self, modules: dict[str, str], max_rank: int) -> None:
        self.paths = dict(modules)
        self.max_rank = max_rank

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def load(self, body: dict) -> str:
        """POST /v1/load_lora_adapter: the success text, or the error vLLM answers."""
        for field in ("lora_name", "lora_path"):
            if field not in body:
                raise missing_field(field, body)
        name, path = str(body["lora_name"]), str(body["lora_path"])
        if name in self.paths and body.get("load_inplace") is not True:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        folder = resolve(path)
        if folder is None:
            raise ApiError(
                404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"
            )
        rank = rank_of(folder)
        if rank > self.max_rank:
            raise ApiError(
                500,
                "Call to add_lora method failed: Worker failed with error 'LoRA rank "
                f"{rank} is greater than max_lora_rank {self.max_rank}.', please check the "
                "stack trace above for the root cause",
                "InternalServerError",
            )
        self.paths[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict) -> str:
        """POST /v1/unload_lora_adapter."""
        if "lora_name" not in body:
            raise missing_field("lora_name", body)
        name = str(body["lora_name"])
        if self.paths.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return f"Success: LoRA adapter '{name}' removed successfully."
