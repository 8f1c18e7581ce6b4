"""Small building blocks shared by every family: RMSNorm, rotary embedding, the gated activations."""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """transformers' RMSNorm: statistics in float32, scaled by the weight in the input dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def interleave_gate_up(gate, up):
    """gate, up: [..., F] (numpy or jax) -> [..., 2F], gate in even columns."""
    if isinstance(gate, np.ndarray):  # two strided writes: np.stack's copy ran 2-20x slower at load
        out = np.empty((*gate.shape, 2), np.result_type(gate, up))
        out[..., 0], out[..., 1] = gate, up
        return out.reshape(*gate.shape[:-1], 2 * gate.shape[-1])
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


@flax.struct.dataclass
class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped above, up clamped both sides at `limit`,
    (up + 1) * gate * sigmoid(alpha * gate). Static (no arrays): it travels through the
    placement seam with the expert weights it belongs to (`experts["act"]`)."""

    alpha: float = flax.struct.field(pytree_node=False)
    limit: float = flax.struct.field(pytree_node=False)

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        glu = gate * jax.nn.sigmoid(gate * self.alpha)
        return (up + 1) * glu


def rope_inv_freq(c: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim / 2] and the cos/sin scale (yarn's attention factor)."""
    rope, dim = c.rope, c.rotary_dim
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    if rope.kind != "yarn":
        return (1.0 / pos_freqs).astype(np.float32), 1.0

    # YaRN, as transformers' _compute_yarn_parameters: blend interpolated and extrapolated
    # frequencies with a linear ramp between the correction dims.
    def correction_dim(rot):
        return dim * math.log(rope.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(rope.cos_sin_scale)


def rope_cos_sin(c: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions: [B, T] -> cos, sin: [B, T, rotary_dim / 2] (float32)."""
    inv_freq, scale = rope_inv_freq(c)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x: [B, T, H, R] rotated on its first 2*len(cos) dims; cos, sin: [B, T, R'/2].

    Interleaved layouts (DeepSeek: pairs (x0, x1), (x2, x3) ...) are de-interleaved first, as
    transformers does; queries and keys are permuted alike, so their dot products are unchanged.
    """
    rot = 2 * cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    if interleave:
        xr = jnp.concatenate([xr[..., 0::2], xr[..., 1::2]], axis=-1)
    x1, x2 = jnp.split(xr.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1) if xp.shape[-1] else out
