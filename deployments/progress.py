"""Progress read from what engines, pulls and downloads print. Pure functions."""

import re

SHARDS_RE = re.compile(r"Loading \S+ checkpoint shards:\s*(\d+)%[^|]*\|\s*(\d+)/(\d+)")
FETCH_RE = re.compile(r"Fetching (\d+) files:\s*(\d+)%[^|]*\|[^|]*\|\s*(\d+)/(\d+)")


def shard_progress(log: str) -> tuple[int, int] | None:
    """(shards loaded, shards in all) from the last vLLM shard line in a log chunk."""
    matches = SHARDS_RE.findall(log.replace("\r", "\n"))
    if not matches:
        return None
    _, done, total = matches[-1]
    return int(done), int(total)


def download_progress(log: str) -> float | None:
    """Percent done from the Hugging Face CLI's ``Fetching N files`` bar (last one seen)."""
    text = log.replace("\r", "\n")
    matches = FETCH_RE.findall(text)
    if matches:
        _, _, done, total = matches[-1]
        return 100.0 * int(done) / int(total) if int(total) else None
    return None


def pull_progress(layers: dict[str, tuple[int, int]]) -> float:
    """Percent of bytes downloaded over the layers Docker reported so far."""
    total = sum(t for _, t in layers.values())
    done = sum(min(c, t) for c, t in layers.values())
    return 100.0 * done / total if total else 0.0


def record_pull_event(layers: dict[str, tuple[int, int]], event: dict) -> None:
    """Fold one decoded ``docker pull`` event into the per-layer (current, total) map."""
    layer, detail = event.get("id"), event.get("progressDetail") or {}
    if not layer:
        return
    if event.get("status") == "Downloading" and detail.get("total"):
        layers[layer] = (int(detail.get("current", 0)), int(detail["total"]))
    elif event.get("status") in {"Download complete", "Pull complete", "Already exists"}:
        _, total = layers.get(layer, (0, 0))
        layers[layer] = (total, total)
