"""Pinned CPU kernels: the same arithmetic on every supported x86 machine, where the arithmetic allows.

PyTorch picks its CPU kernels by what the processor offers: ATen's vectorised kernels by the CPU
capability (``ATEN_CPU_CAPABILITY``: default, avx2, avx512), oneDNN's convolutions and matrix
products by the widest instruction set (``ONEDNN_MAX_CPU_ISA``; ``DNNL_MAX_CPU_ISA`` for older
oneDNN), and reductions split their sums over the intra-op threads. Different kernels sum in
different orders, so the same cell trained on an AVX-512 and an AVX2 machine drifts apart from the
first round. Pinning all three to AVX2 (which every x86-64 machine fedweigh supports has) and fixing
the thread count removes that difference. It does not remove all of them: oneDNN sizes its blocks by
the caches and MKL dispatches by processor, so two machines with different processors can still
differ in the last bits (measured: docs/bench.md). Machines with the same processor
(:func:`cpu_identity`) and torch build compute a cell bit for bit alike.

The bench runner and the NVFlare simulator launched by ``fedweigh`` set them (:func:`pin_cpu_kernels`,
:func:`pinned_env`); they must be in the environment before the process runs its first CPU kernel,
so they take effect in the processes started afterwards (the bench's workers, the simulator's sites)
and in the current one only if it has computed nothing yet (:func:`kernel_state` says what is in
force). ``FEDWEIGH_CPU_KERNELS=native`` turns the pin off (each machine its fastest kernels); a value
the user set for one of the variables is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "KERNEL_SWITCH",
    "PINNED_KERNELS",
    "cpu_identity",
    "kernel_state",
    "pin_cpu_kernels",
    "pinned_env",
]

#: What selects the CPU kernels, pinned to AVX2.
PINNED_KERNELS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
}
#: Environment variable that turns the pin off: ``native``.
KERNEL_SWITCH = "FEDWEIGH_CPU_KERNELS"
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: The vector instruction sets the CPU kernels choose between (``/proc/cpuinfo`` flags).
_VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
)


def pinned_env(base: Mapping[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the kernel pins added where unset, and
    ``threads`` as OMP_NUM_THREADS / MKL_NUM_THREADS where given; unchanged under ``native``."""
    env = dict(os.environ if base is None else base)
    if env.get(KERNEL_SWITCH, "").lower() == "native":
        return env
    for key, value in PINNED_KERNELS.items():
        env.setdefault(key, value)
    if threads is not None:
        if int(threads) != threads or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        for key in _THREAD_VARS:
            env[key] = str(int(threads))
    return env


def pin_cpu_kernels(threads: int | None = None) -> dict[str, str]:
    """Put the pins into this process's environment (:func:`pinned_env`), so that every process it
    starts, and this one if it has run no CPU kernel yet, uses them; returns :func:`kernel_state`."""
    env = pinned_env(threads=threads)
    for key in (*PINNED_KERNELS, *_THREAD_VARS):
        if key in env:
            os.environ[key] = env[key]
    return kernel_state()


def kernel_state() -> dict[str, str]:
    """What this process computes with: torch's version, its CPU capability (fixed by the first CPU
    kernel), intra-op threads, and the pin variables as set."""
    import torch

    return {
        "torch": torch.__version__,
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "threads": str(torch.get_num_threads()),
        **{key: os.environ.get(key, "") for key in (*PINNED_KERNELS, KERNEL_SWITCH)},
    }


def cpu_identity(cpuinfo: str | None = None) -> dict[str, str]:
    """The processor, as ``/proc/cpuinfo`` names it: vendor, family, model, stepping, and which of the
    vector instruction sets the kernels choose between it has. ``cpuinfo`` is that file's text (read
    from the machine when None); a field it lacks (another OS, another architecture) is "unknown"."""
    if cpuinfo is None:
        try:
            cpuinfo = open("/proc/cpuinfo", encoding="utf-8").read()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if first:  # a blank line ends the first processor's block
                break
            continue
        first.setdefault(key.strip(), value.strip())
    flags = set(first.get("flags", "").split())
    return {
        "vendor": first.get("vendor_id", "unknown"),
        "family": first.get("cpu family", "unknown"),
        "model": first.get("model", "unknown"),
        "stepping": first.get("stepping", "unknown"),
        "vector": " ".join(f for f in _VECTOR_FLAGS if f in flags) or "unknown",
    }
