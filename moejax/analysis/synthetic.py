"""Synthetic router traces: `moejax record --synthetic glm-like`, to show the method without a model.

Generative model of decode steps (one row per running request per step), per MoE layer l:

  * popularity: a logit per expert, sigma_l * z[e], z the E quantiles of a blend of a normal and a
    (right-skewed) Gumbel law, standardized, then placed at random over the expert ids, as a trained
    router's favourites are. Quantiles rather than draws, so a layer's hottest expert is set by
    sigma_l alone and not by the luck of the largest of 256 draws. sigma_l is spread over the layers
    because Row-Meets-Experts finds the busiest expert of a layer at 2.9x to 14x the mean depending on the layer;
  * persistence: each request adds its own logit offset tau * N(0, 1) per expert for its whole
    life, so consecutive steps of a request favour the same experts (what EPLB, fitted on past
    steps, cannot foresee);
  * a row's score for each expert is popularity + its request's offset + N(0, 1) row noise (a
    router's scores are a linear map of a roughly Gaussian hidden state), and the row picks its
    top k;
  * `rows` request slots; a request lives `lifetime` steps (Row-Meets-Experts: 150 output tokens per request),
    the first ones with staggered remaining lives, then a new request takes the slot.

How GLM_LIKE was fitted (300 steps x 64 rows x 75 layers, seeds 0 and 1, scored by `analyze`):
sigma_max sets the most skewed layer's busiest expert (14x), sigma_min the least skewed (2.9x);
the spacing exponent (0.7: more layers near sigma_max) and the Gumbel share of the tail then set
the balancedness on 8, 16 and 32 devices. Result: balancedness 0.75-0.76 / 0.61-0.62 / 0.47
(Row-Meets-Experts: 0.75 / 0.61 / 0.46), EPLB with 32 spare slots 0.86 / 0.78 / 0.68 (0.86 / 0.78 / 0.67),
busiest expert 3.0x-14.4x (2.9x-14x), 19 of 512 picks per step (17), experts touched 70% (72%).
No setting tried reached both 72% touched and 0.46 on 32 devices: skew enough for the balancedness
leaves fewer experts touched than the real router does. A normal-only popularity (tail 0) touches
72% but stays at 0.63 / 0.49 on 16 / 32 devices; Gumbel row noise in place of normal moves touched
up but the busiest expert to 21 picks.
"""

from __future__ import annotations

import dataclasses
from statistics import NormalDist

import numpy as np


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    num_experts: int
    k: int
    moe_layers: tuple[int, ...]  # model layer index of each MoE layer
    sigma_min: float  # popularity skew of the least skewed layer
    sigma_max: float  # ... and of the most skewed one
    spacing: float  # sigma_l = sigma_min + (sigma_max - sigma_min) * u**spacing, u evenly over [0, 1]
    tail: float  # 0: normal popularity quantiles, 1: Gumbel (a few very hot experts)
    tau: float  # per-request persistence (logit offset scale)
    lifetime: int  # decode steps per request
    model: str


GLM_LIKE = SyntheticSpec(
    num_experts=256,
    k=8,
    moe_layers=tuple(range(3, 78)),
    sigma_min=0.16,
    sigma_max=0.56,
    spacing=0.7,
    tail=0.5,
    tau=0.2,
    lifetime=150,
    model="synthetic glm-like (GLM-5.3 geometry, skew fitted to Row-Meets-Experts)",
)
SPECS = {"glm-like": GLM_LIKE}


def popularity_quantiles(num_experts: int, tail: float) -> np.ndarray:
    """float[E]: standardized popularity logits, a blend of normal (tail 0) and Gumbel (tail 1) quantiles."""
    p = (np.arange(num_experts) + 0.5) / num_experts
    normal = np.array([NormalDist().inv_cdf(q) for q in p])
    gumbel = -np.log(-np.log(p))
    blend = (1 - tail) * normal + tail * (gumbel - gumbel.mean()) / gumbel.std()
    return (blend - blend.mean()) / blend.std()


def generate(spec: SyntheticSpec, steps: int, rows: int, seed: int) -> dict:
    """Keyword arguments for `save_trace`: ids int32[steps, L, rows, k], all rows valid, all decode."""
    rng = np.random.default_rng(seed)
    e, l = spec.num_experts, len(spec.moe_layers)
    spread = np.linspace(0, 1, l) ** spec.spacing
    sigma = (spec.sigma_min + (spec.sigma_max - spec.sigma_min) * spread)[
        rng.permutation(l)
    ]  # layer order means nothing
    z = rng.permuted(np.broadcast_to(popularity_quantiles(e, spec.tail), (l, e)), axis=1)
    popularity = sigma[:, None] * z  # [L, E]
    remaining = rng.integers(1, spec.lifetime + 1, size=rows)  # [rows]: steps left of each slot's request
    # [L, rows, E]: popularity plus the persistent offset of each slot's current request
    base = (popularity[:, None, :] + spec.tau * rng.standard_normal((l, rows, e))).astype(np.float32)
    ids = np.empty((steps, l, rows, spec.k), dtype=np.int32)
    for s in range(steps):
        ended = remaining == 0
        if ended.any():  # new requests take the freed slots
            fresh = spec.tau * rng.standard_normal((l, int(ended.sum()), e))
            base[:, ended] = popularity[:, None, :] + fresh
            remaining[ended] = spec.lifetime
        scores = base + rng.standard_normal((l, rows, e), dtype=np.float32)
        ids[s] = np.argpartition(-scores, spec.k - 1, axis=-1)[..., : spec.k]
        remaining -= 1
    return dict(
        ids=ids,
        valid=np.ones((steps, rows), dtype=bool),
        kind=np.full(steps, "decode"),
        layers=np.array(spec.moe_layers),
        num_experts=e,
        model=spec.model,
    )
