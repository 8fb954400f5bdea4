"""What the machine computes natively (no Django, no torch import)."""

from __future__ import annotations


def cpu_has_bf16() -> bool:
    """True on CPUs with native bf16 matrix instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = handle.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
