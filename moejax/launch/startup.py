"""Process start-up settings that must be in place before jax is first imported, or before a
model is loaded.

jax reads its persistent compile cache settings from the environment when it is imported, so
the CLI calls `configure_compile_cache` before anything imports jax (building the argument
parser does). A user's own JAX_* settings win: tests point the cache at a temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import sys

DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "moejax", "xla")

# A short run compiles dozens of small programs (parameter init, sampling, prefill and decode
# of a tiny model); jax by default only caches programs that took over 1 s to compile, which
# leaves most of a warm start's time in recompiling them.
CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def configure_compile_cache() -> str:
    """Point jax's persistent compile cache at ~/.cache/moejax/xla (or JAX_COMPILATION_CACHE_DIR)
    and cache every program. Returns the cache directory."""
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser(DEFAULT_CACHE_DIR))
    for name, value in CACHE_ENV.items():
        os.environ.setdefault(name, value)
    if "jax" in sys.modules:  # called in-process after jax's import (tests): set what jax read already
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        for name in CACHE_ENV:
            jax.config.update(name.lower(), float(os.environ[name]) if "SECS" in name else int(os.environ[name]))
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


def jax_platforms() -> str:
    """JAX_PLATFORMS for this process: the user's, else "cpu" on a host with no accelerator
    attached (`platform.host_alone`), else jax's own choice (""). Before jax's import."""
    from moejax.base import platform

    if platform.host_alone():
        _load_plugins_quietly()
    return os.environ.get("JAX_PLATFORMS", "")


def _load_plugins_quietly() -> None:
    """Import jax and load its PJRT plugins with the process's stderr shut. On a host without a
    GPU, the CUDA plugin of the `targets` extra (which only compiles here) logs its missing driver
    from C++ as jax imports and loads it, six lines on every command."""
    with _native_stderr_shut():
        try:
            from jax._src import xla_bridge

            xla_bridge._discover_and_register_pjrt_plugins()
        except (ImportError, AttributeError):  # another jax: it loads them at its backends' start
            pass


@contextlib.contextmanager
def _native_stderr_shut():
    """The process's stderr (file descriptor 2, where C++ logs go) to /dev/null for the block; an
    exception still comes out of it, and the CLI prints it after."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def quiet_native_logs() -> None:
    """Before jax's import: XLA's C++ logs (jaxlib's and its compiler plugins') at FATAL only,
    unless the environment sets TF_CPP_MIN_LOG_LEVEL. What they say is the CLI's to report: for a
    program larger than the GPU, XLA:GPU logs "The byte size of input/output arguments ...
    exceeds the base limit" and a rematerialization warning, lines before `plan`'s table, which
    reports the same."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def start_tpu_compiler_quietly(target: str | None) -> None:
    """libtpu started with the process's stderr shut, when `target` names a compile-only TPU on a
    host where jax runs on the CPU: there libtpu logs from C++ that it finds no TPU (its
    accelerator type, its hosts) as it starts, before any log setting applies, five lines ahead
    of the verb's own output or its one-line refusal."""
    from moejax.base import platform, targets

    t = targets.TARGETS.get(target)
    if t is None or not platform.resolve(t.platform).starts_loudly or not platform.host_alone():
        return
    with _native_stderr_shut():
        targets.devices(t.name, 1)


def host_pages() -> bool:
    """Numpy's large buffers on the kernel's small pages (numpy asks for 2 MB pages by default),
    unless NUMPY_MADVISE_HUGEPAGE says otherwise. Returns whether numpy asks for 2 MB pages.

    A load's host buffers (a layer's experts as read, then put on their devices) are written
    once and dropped: 2 MB pages save them nothing, and on a host where a fresh 2 MB page is
    slow to come by a start's time spreads by seconds (docs/cpu-host.md)."""
    from numpy._core import multiarray

    wanted = os.environ.get("NUMPY_MADVISE_HUGEPAGE", "0") != "0"
    multiarray._set_madvise_hugepage(wanted)
    return wanted
