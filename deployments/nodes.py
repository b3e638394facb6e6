"""Facts about the machine this process runs on, for registering the local node."""

import os
import platform

from deployments.choices import Arch

_ARCH = {"x86_64": Arch.AMD64, "amd64": Arch.AMD64, "aarch64": Arch.ARM64, "arm64": Arch.ARM64}


def local_arch() -> str:
    """This machine's architecture in Docker's naming (amd64/arm64)."""
    return _ARCH.get(platform.machine().lower(), platform.machine().lower())


def local_memory_bytes() -> int:
    """Total memory from /proc/meminfo (on GB10 the GPU shares it), 0 when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
