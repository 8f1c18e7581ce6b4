"""What passes between the host and the engine's jitted steps: results gathered to numpy, a routing
override's picks, the rows' sampling seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def to_host(x: jax.Array) -> np.ndarray:
    """A device array as numpy, gathered from every process when it spans several (multi-host)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def forced(dealer, kind: str, valid: np.ndarray) -> jax.Array | None:
    """A routing override's picks for one forward pass whose real rows are `valid`, as the jitted
    step's input (None without an override: the router's own)."""
    return None if dealer is None else jnp.asarray(dealer.picks(kind, valid))


def seed_rows(seed: int, batch: int) -> np.ndarray:
    """Sampling seeds of a batch's rows: prompt i samples as a request of seed `seed` + i alone."""
    return ((seed + np.arange(batch)) & 0x7FFFFFFF).astype(np.int32)
