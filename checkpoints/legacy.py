"""Checkpoints of format version 2, which stored gate and up apart: their keys, and the
restored halves fused into the gate_up matrix a run multiplies by (`checkpoints.gate_up`)."""

from __future__ import annotations

import dataclasses

import jax

from checkpoints.gate_up import fuse
from moejax.model.params import ParamSpec
from sharding import rules

_HALVES = {"gate_up": ("gate", "up"), "gate_up_bias": ("gate_bias", "up_bias")}


def _halves(key: str) -> tuple[str, str]:
    base, _, leaf = key.rpartition(".")
    return tuple(f"{base}.{half}" for half in _HALVES[leaf])


def stored_names(names: list[tuple[str, ParamSpec]]) -> list[tuple[str, ParamSpec]]:
    """The model's (key, spec) pairs as version 2 stored them: each gate_up as gate and up."""
    out = []
    for key, spec in names:
        if not spec.gated:
            out.append((key, spec))
            continue
        half = dataclasses.replace(spec, shape=(*spec.shape[:-1], spec.shape[-1] // 2), gated=False)
        out += [(k, half) for k in _halves(key)]
    return out


def fused(restored: dict, names: list[tuple[str, ParamSpec]], placement) -> dict:
    """Restored version-2 arrays by key -> the model's, each gate and up pair as its gate_up,
    put where the placement keeps it."""
    out = {}
    for key, spec in names:
        if not spec.gated:
            out[key] = restored[key]
            continue
        gate, up = (restored.pop(k) for k in _halves(key))

        def where(a, spec=spec):
            sharding = placement.sharding(rules.leaf_axes(spec.axes, a.ndim), a.shape)
            return a if sharding is None else jax.device_put(a, sharding)

        out[key] = jax.tree.map(where, fuse(gate, up))
    return out
