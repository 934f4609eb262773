"""The ATEN_CPU_CAPABILITY values this machine's CPU can run, lowest first (.ci/run's loop).

torch picks the highest its build knows and the CPU has; forcing a lower one runs
the same code through other vector kernels, whose float rounding differs in the
last bits. ``default`` always runs; ``avx2`` needs AVX2 and FMA; ``avx512`` needs
AVX-512 F, BW, VL and DQ (torch's own check). Elsewhere than Linux/x86 only
``default`` is listed.
"""

from __future__ import annotations

import platform


def flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def capabilities() -> list[str]:
    out = ["default"]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return out
    have = flags()
    if {"avx2", "fma"} <= have:
        out.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have:
        out.append("avx512")
    return out


if __name__ == "__main__":
    print(" ".join(capabilities()))
