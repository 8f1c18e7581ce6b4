"""The engine's jitted programs: its step functions (`steps.py`) bound to a model and a placement,
traced at the run's matmul precision and compiled with its platform's compiler options."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from moejax.base.platform import Platform
from moejax.config import ModelConfig
from moejax.engine.steps import decode_step, decode_steps, prefill


def jit_program(fn, dtype, platform: Platform, *, decode: bool = False, **jit_kwargs):
    """jax.jit of an engine program of a run in `dtype` on `platform` (the placement's): traced at the
    run's matmul precision, compiled with its compiler options (`decode`: those of a decode program)."""
    return jax.jit(
        platform.at_matmul_precision(fn, dtype),
        compiler_options=platform.compiler_options(dtype, decode),
        **jit_kwargs,
    )


class Programs(NamedTuple):
    """An engine's jitted steps, each donating its cache (argument 1)."""

    prefill: object  # `steps.prefill`
    decode: object  # `steps.decode_step`
    decode_block: object  # `steps.decode_steps`


def step_programs(c: ModelConfig, placement, dtype) -> Programs:
    """The step functions of model `c` under `placement`, jitted for a run in `dtype` on its platform."""
    bind = dict(c=c, placement=placement)
    jit = functools.partial(jit_program, dtype=dtype, platform=placement.platform, donate_argnums=1)
    return Programs(
        jit(functools.partial(prefill, **bind), static_argnames=("all_logits", "record", "visible")),
        jit(functools.partial(decode_step, **bind), decode=True, static_argnames=("sampling", "record")),
        jit(functools.partial(decode_steps, **bind), decode=True, static_argnames=("block", "sampling", "visible")),
    )
