"""What a box is, read from /proc: its GPUs and its available memory (no Docker needed)."""

from pathlib import Path


def gpu_facts(proc: Path = Path("/proc/driver/nvidia/gpus")) -> tuple[int, str]:
    """(GPU count, description) from the NVIDIA driver's /proc entries, (0, "") without."""
    models = []
    for entry in sorted(proc.glob("*/information")) if proc.exists() else []:
        for line in entry.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                models.append(line.split(":", 1)[1].strip())
    if not models:
        return 0, ""
    return len(models), ", ".join(sorted(set(models)))


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def box_facts() -> dict[str, object]:
    gpus, description = gpu_facts()
    return {
        "gpu_count": gpus,
        "gpu_description": description,
        "available_memory_bytes": available_memory_bytes(),
    }
