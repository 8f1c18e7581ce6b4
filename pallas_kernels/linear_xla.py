"""`fused_linear_xla`: `linear.fused_linear` with XLA ops, one product per segment: the same
arguments (less its tiles) and results, the reference the kernel is held to."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import epilogue
from pallas_kernels.linear_segments import PRECISIONS, check_normed, rms_norm, rotate_half, segments


def fused_linear_xla(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    biases: tuple[jax.Array | None, ...] | None = None,
    residual: jax.Array | None = None,
    head_dim: int | tuple[int | None, ...] | None = None,
    head_norms: tuple[jax.Array | None, ...] | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
    rotate: tuple[bool, ...] | None = None,
    rope_at: tuple[int, ...] | None = None,
    interleave: tuple[bool, ...] | None = None,
    windows: tuple[tuple[int, int] | None, ...] | None = None,
    act=None,
    out_dtype=None,
    normed: bool = False,
    precision: str | None = None,
) -> tuple[jax.Array, ...]:
    """`fused_linear` with XLA ops: the same arguments (less its tiles) and results."""
    if precision not in PRECISIONS:
        raise ValueError(f"fused_linear: precision must be one of {PRECISIONS}, got {precision!r}")
    check_normed(normed, norm)
    laid_out = segments(
        x,
        weights,
        norm=norm,
        biases=biases,
        residual=residual,
        head_dim=head_dim,
        head_norms=head_norms,
        rope=rope,
        rotate=rotate,
        act=act,
        out_dtype=out_dtype,
        tn=None,
        rope_at=rope_at,
        interleave=interleave,
        windows=windows,
    )
    m = x.shape[0]
    h = x if norm is None else rms_norm(x, norm, eps)
    outs = []
    for i, (w, seg) in enumerate(zip(weights, laid_out)):
        w = w[:, seg.start * seg.pairs : seg.start * seg.pairs + seg.n * seg.pairs]  # its window
        acc = jnp.dot(
            h.astype(seg.cdtype), w.astype(seg.cdtype), preferred_element_type=jnp.float32, precision=precision
        )
        y = epilogue.finish(acc, seg.out_dtype, bias=None if biases is None else biases[i])
        if act is not None:
            y = epilogue.glu(*(c.astype(jnp.float32) for c in epilogue.gate_up_columns(y)), act).astype(seg.out_dtype)
        if seg.head_norm or seg.rotate:
            y = y.reshape(m, -1, seg.tile)  # [M, H, Dh]
            if seg.head_norm:
                y = rms_norm(y, head_norms[i], eps).astype(seg.out_dtype)
            if seg.rotate:
                half, at = rope[0].shape[-1], rope_at[i] if rope_at else 0
                cos, sin = (a[:, None, :] for a in rope)
                yf = y[..., at : at + 2 * half].astype(jnp.float32)
                x1, x2 = (
                    (yf[..., 0::2], yf[..., 1::2]) if interleave and interleave[i] else (yf[..., :half], yf[..., half:])
                )
                rotated = jnp.concatenate(rotate_half(x1, x2, cos, sin), axis=-1)
                y = jnp.concatenate([y[..., :at], rotated.astype(seg.out_dtype), y[..., at + 2 * half :]], axis=-1)
            y = y.reshape(m, -1)
        if residual is not None:
            y = (residual + y).astype(seg.out_dtype)
        outs.append(y)
    return (h, *outs) if normed else tuple(outs)
