"""glibc malloc's thresholds for a training process whose tensors live in host memory (``training.cpu_malloc``).

A CPU step frees and allocates the same large activations and gradients every step. glibc's defaults hand the
free top of the heap back to the kernel whenever it passes a (dynamic) trim threshold of at most 64 MiB, and serve
blocks over the (dynamic) mmap threshold with fresh mappings: the next step faults those pages in again, each one
zeroed by the kernel, and in a process with several compute threads the faults queue on the address space's lock.
On the debug model at one process (2 threads) that was 13 k minor faults a step against 8 k for torchtitan-2024 and
~1.2% of the CPU time in the kernel; with the thresholds below, 2 k faults in 20 s instead of 310 k and a median
+6% tokens/s over 7 alternating rounds, the losses bit for bit the same. With one thread per process (FSDP2 at 2
ranks on 2 cores) the faults cost no contention and the thresholds read 3.5% slower (median of 8 rounds), so
``auto`` leaves such a process alone (docs/performance.md).

``tuned``: blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap's free top is
trimmed only past 1 GiB, so a step reuses the pages the last one touched. The peak resident set is the same (the
step's peak recurs every step); memory freed after a larger peak (e.g. loading a checkpoint) stays with the
process, up to 1 GiB at the top of the heap. Process-wide and for the rest of the process (glibc has no getter to
put the old values back).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); a larger value is refused
TRIM_THRESHOLD = 1 << 30


def user_malloc_settings() -> list[str]:
    """The environment's own malloc settings, which ``auto`` leaves alone: glibc's MALLOC_*_ variables, its
    malloc tunables, another allocator preloaded."""
    found = [name for name in os.environ if name.startswith("MALLOC_") and name.endswith("_")]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        found.append("GLIBC_TUNABLES")
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        found.append("LD_PRELOAD")
    return sorted(found)


@functools.cache  # platform.libc_ver reads the interpreter's binary: once a process, not once a Trainer
def _mallopt():
    """glibc's ``mallopt`` or None (another C library: musl, macOS)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return getattr(ctypes.CDLL(None), "mallopt", None)


def tune_cpu_malloc(mode: str, device_type: str, threads: int) -> bool:
    """Apply ``training.cpu_malloc`` (the config checks ``mode``; see the module docstring); returns whether the
    thresholds were set.

    ``auto``: set them where the model trains on the CPU (``device_type``) with more than one compute thread in the
    process (``threads``) and glibc, unless the environment has malloc settings of its own. ``tuned``: set them
    anyway, or refuse (no glibc). ``system``: leave malloc as the process started it.
    """
    if mode == "system" or (mode == "auto" and (device_type != "cpu" or threads < 2)):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        if mode == "tuned":
            raise ValueError(
                f"training.cpu_malloc = 'tuned' sets glibc malloc's thresholds, and this process's C library is "
                f"{platform.libc_ver()[0] or 'not glibc'} on {platform.system()}: set training.cpu_malloc to auto "
                f"or system"
            )
        return False
    own = user_malloc_settings() if mode == "auto" else []
    if own:
        logger.debug("training.cpu_malloc = auto: the environment sets %s; malloc left as it is", own)
        return False
    for option, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if mallopt(option, value) != 1:  # glibc returns 1 on success
            raise RuntimeError(f"glibc mallopt({option}, {value}) failed")
    return True
