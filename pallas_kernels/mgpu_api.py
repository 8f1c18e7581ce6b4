"""Mosaic GPU calls whose signatures moved between the jax versions the project's ranges admit,
each written once so that the kernels read the same on every one."""

from __future__ import annotations

import inspect

from jax.experimental.pallas import mosaic_gpu as plgpu

# `plgpu.load(ref, idx, ...)`: jax 0.10.2 takes the index as a second argument, 0.11 deprecates it
# (the ref is indexed instead: `ref.at[idx]`) and 0.12 removes it.
_INDEX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_TAKES_INDEX = _INDEX is not None and _INDEX.default is inspect.Parameter.empty


def load(ref, layout, optimized: bool = True):
    """The whole of `ref` (index it first: `ref.at[...]`) into registers in `layout`; `optimized`
    False: element by element (a GMEM ref, which has no vector plan)."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def store_untiled(ref, value) -> None:
    """value into the whole of an untiled SMEM `ref`. jax 0.12 plans such a store of a wgmma
    layout only where it avoids bank conflicts (a [64, 64+] tile's rows do not: its Lane lowering
    refuses it) and adds `plgpu.store(.., optimized=False)` for the plain one; jax 0.10.2 and 0.11
    have no `plgpu.store` and store it by indexing."""
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value
