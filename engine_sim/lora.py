"""LoRA adapters, as vLLM serves them beside its base model.

Named at start (``--enable-lora --lora-modules name=path``) or loaded and unloaded at run
time (``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, routes that exist only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true). A request names an adapter as its
``model``; the simulator's answer then differs from the base's (its reply plan is seeded
with the adapter's path too: the same files under two names answer alike, as in vLLM).
Paths resolve as vLLM resolves them: a local folder, or a hub repository id found in the
Hugging Face cache (``$HF_HOME/hub``). An adapter's rank is read from its
``adapter_config.json``; above ``--max-lora-rank`` the load fails as vLLM's worker fails it.
Answers and errors are vLLM 0.32's, word for word (tests/vllm/fidelity_scenarios.py holds
the simulator to the real engine).

Two tables, as in vLLM. The server's: the names requests may use (``/v1/models`` lists
them); unloading only takes a name out of it, so requests already sent on the adapter run
to their end. The worker's: an LRU cache of ``--max-cpu-loras`` adapters (default
``--max-loras``). A load puts the adapter in it; a request on an adapter that was pushed out
reads it again from its path when it is scheduled, and when the files are gone by then the
engine dies (vLLM's worker raises in the engine loop).

Reading an adapter takes ``--sim-lora-load-ms`` (default 0): a runtime load answers after it,
and a request on an adapter read again waits for it before its first token (vLLM reads the
weights from disk and copies them to the device either way)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Adapter:
    """One load of an adapter: its served name, the path it was given, and vLLM's
    ``lora_int_id`` (a new one per load, so a name loaded again is a new adapter)."""

    name: str
    path: str
    id: int


def invalid(message: str) -> ApiError:
    return ApiError(400, message, "InvalidUserInput")


class Adapters:
    """The adapters an engine serves (the server's table) and holds (the worker's cache)."""

    def __init__(
        self,
        modules: dict[str, str],
        max_rank: int,
        base_names: list[str],
        cache_size: int,
        read_seconds: float = 0.0,
    ) -> None:
        self.max_rank = max_rank
        self.read_seconds = read_seconds  # --sim-lora-load-ms
        self.base_names = set(base_names)
        self.cache_size = max(1, cache_size)
        self._ids = itertools.count(1)
        self.served: dict[str, Adapter] = {}
        self.cached: OrderedDict[int, Adapter] = OrderedDict()  # least recently used first
        for name, path in modules.items():
            self._add(self._read(name, path))

    def __contains__(self, name: object) -> bool:
        return name in self.served

    def get(self, name: object) -> Adapter | None:
        return self.served.get(name) if isinstance(name, str) else None

    @property
    def paths(self) -> dict[str, str]:
        """Served name -> the path it was loaded from, in load order."""
        return {name: adapter.path for name, adapter in self.served.items()}

    async def load(self, body: dict) -> str:
        """POST /v1/load_lora_adapter: the success text, or the error vLLM answers."""
        for field in ("lora_name", "lora_path"):
            if field not in body:
                raise missing_field(field, body)
        name, path = str(body["lora_name"] or ""), str(body["lora_path"] or "")
        if not name or not path:
            raise invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.base_names:
            raise invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.served and body.get("load_inplace") is not True:
            raise invalid(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        adapter = self._read(name, path)
        if self.read_seconds:
            await asyncio.sleep(self.read_seconds)
        self._add(adapter)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _read(self, name: str, path: str) -> Adapter:
        """Check the adapter's files as vLLM's worker does (errors as its add_lora call
        reports them)."""
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
        known = self.served.get(name)
        return Adapter(name, path, known.id if known else next(self._ids))

    def _add(self, adapter: Adapter) -> None:
        """Put the adapter in the worker's cache and serve it under its name."""
        self.cached.pop(adapter.id, None)  # load_inplace: the new files replace the old
        self._cache(adapter)
        self.served[adapter.name] = adapter

    def _cache(self, adapter: Adapter) -> None:
        self.cached[adapter.id] = adapter
        while len(self.cached) > self.cache_size:
            self.cached.popitem(last=False)

    def unload(self, body: dict) -> str:
        """POST /v1/unload_lora_adapter: the name goes; the worker keeps the weights."""
        if "lora_name" not in body:
            raise missing_field("lora_name", body)
        name = str(body["lora_name"] or "")
        if not name:
            raise invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if self.served.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def activate(self, adapter: Adapter) -> float | None:
        """A request on ``adapter`` is scheduled: it is used from the cache (0 s), or read
        again from its path (pushing out the least recently used; the seconds that takes).
        None when its files are gone: vLLM's engine dies of that."""
        if adapter.id in self.cached:
            self.cached.move_to_end(adapter.id)
            return 0.0
        if resolve(adapter.path) is None:
            return None
        self._cache(adapter)
        return self.read_seconds
