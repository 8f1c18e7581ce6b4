"""Abstract arrays on a compile-only accelerator (`moejax.base.targets`): a jit lowered and compiled over
them runs the target's own compiler (XLA:GPU's Triton lowering for an H100), here, without one."""

import jax

from moejax.base import targets


def on(target: str, shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract array on one compile-only device of `target`."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(targets.devices(target, 1)[0]))


def on_h100(shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract array on a compile-only H100."""
    return on("h100", shape, dtype)


def lower(jitted, *args, **kwargs):
    """`jitted` lowered over `args` (abstract arrays on a target's compile-only devices) for that
    target (`targets.lowering`: the GPU Pallas's Triton lowering writes for)."""
    with targets.lowering(*args):
        return jitted.lower(*args, **kwargs)
