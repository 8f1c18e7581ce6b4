"""Closed-form numbers for one MoE model on N devices (Row-Meets-Experts §1, §2, §4.3, §5.4 and §7).

Everything here is arithmetic on the model's dimensions plus an *even router*: every row
picks k distinct experts uniformly at random, independently of the other rows. No devices
and no model run are needed.

An expert is gate_up [2 x moe_intermediate, hidden] (reduce over hidden; gate and up as one
matrix, each half with its own NVFP4 tensor scale, so its bytes are those of two
[moe_intermediate, hidden] matrices) and down [hidden, moe_intermediate] (reduce over
moe_intermediate). 4-bit formats keep their block scales along the reduction dim, as the
grouped GEMM consumes them.
"""

from __future__ import annotations

import math

import numpy as np

from moejax.config import ModelConfig
from moejax.model.attention import cache_specs

# Keys of every bytes-per-expert dict (the `calc --json` contract).
EXPERT_BYTE_KEYS = ("bf16", "nvfp4_values", "nvfp4", "mxfp4")
# (bits per value, values per scale block, bytes per block scale, bytes of the per-matrix scale)
_FORMATS = {
    "bf16": (16, None, 0, 0),
    "nvfp4_values": (4, None, 0, 0),  # Row-Meets-Experts's "18.9 MB": 4-bit values without scales
    "nvfp4": (4, 16, 1, 4),  # e2m1 + e4m3 per 16 values + one f32 tensor scale per matrix
    "mxfp4": (4, 32, 1, 0),  # e2m1 + e8m0 per 32 values
}
# Monte Carlo draws of the even router: about this many rows in all (at least 100 steps), so
# the standard error of the mean balancedness stays near 0.001 at any batch size.
_EVEN_ROWS = 256_000
_EVEN_SEED = 0


def matrix_bytes(out_dim: int, in_dim: int, fmt: str) -> int:
    """Bytes of one [out_dim, in_dim] weight matrix reduced over in_dim, stored in `fmt`."""
    bits, block, scale_bytes, tensor_scale = _FORMATS[fmt]
    values = math.ceil(out_dim * in_dim * bits / 8)
    scales = out_dim * math.ceil(in_dim / block) * scale_bytes if block else 0
    return values + scales + tensor_scale


def expert_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def expert_bytes(cfg: ModelConfig) -> dict[str, int]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return {f: 2 * matrix_bytes(i, h, f) + matrix_bytes(h, i, f) for f in EXPERT_BYTE_KEYS}  # gate_up, down


def row_bytes(cfg: ModelConfig) -> dict[str, int]:
    """One row as dispatched: bf16, or NVFP4 values plus one e4m3 scale per 16 (Row-Meets-Experts: 3,456 B).

    A dispatched 4-bit row carries no tensor scale of its own: that is per batch, not per row."""
    h = cfg.hidden_size
    return {"bf16": 2 * h, "nvfp4": h // 2 + math.ceil(h / 16)}


def experts_per_device(num_experts: int, n: int) -> np.ndarray:
    """int[n]: whole experts per device; the first E % n devices hold one more when n does not divide E."""
    return num_experts // n + (np.arange(n) < num_experts % n)


def devices_per_row(num_experts: int, k: int, n: int) -> float:
    """Expected devices holding at least one of a row's k experts (Row-Meets-Experts §4.3).

    A device with m experts holds none of the row's k with probability C(E - m, k) / C(E, k)."""
    total = math.comb(num_experts, k)
    return float(sum(1 - math.comb(num_experts - int(m), k) / total for m in experts_per_device(num_experts, n)))


def copies_sent_per_row(num_experts: int, k: int, n: int) -> float:
    """Copies a row sends when rows travel to their experts: devices_per_row minus the row's own device.

    Under DP attention a row sits on one device independent of its picks, so its own device is
    among its experts' devices with probability devices_per_row / n, and the expected copies are
    devices_per_row * (1 - 1/n). This is the formula that reproduces Row-Meets-Experts's 4.6 copies on 8
    devices (two-thirds of rows: 5.3 / 8), 6.1 on 16 and 7.0 on 32; subtracting a whole 1 would give
    4.3, 5.5 and 6.3."""
    return devices_per_row(num_experts, k, n) * (1 - 1 / n)


def slice_width(moe_intermediate_size: int, n: int) -> int | None:
    """Sliced experts: each device's share of an expert's intermediate dim; None where n does not divide it."""
    return moe_intermediate_size // n if moe_intermediate_size % n == 0 else None


def even_touched_fraction(num_experts: int, k: int, tokens: int) -> float:
    """Fraction of experts an even router touches in a T-token step: 1 - (1 - k/E)^T.

    A row misses a given expert with probability 1 - k/E exactly, and rows are independent."""
    return 1 - (1 - k / num_experts) ** tokens


def even_device_picks(num_experts: int, k: int, n: int, tokens: int, steps: int, seed: int) -> np.ndarray:
    """int[steps, n]: picks per device in `steps` sampled even-router steps of `tokens` rows.

    A row's picks per device follow a multivariate hypergeometric law (k draws without replacement
    from E experts coloured by device); sampling that law directly avoids drawing expert ids."""
    rng = np.random.default_rng(seed)
    colors = experts_per_device(num_experts, n)
    return rng.multivariate_hypergeometric(colors, k, size=(steps, tokens), method="marginals").sum(axis=1)


def even_balance(num_experts: int, k: int, n: int, tokens: int) -> tuple[float, float]:
    """(expected balancedness, expected busiest device's picks) of an even router, by seeded Monte Carlo.

    No closed form exists for the expected maximum of the device counts. The mean of mean/max over
    steps is SGLang's balancedness averaged over steps, as Row-Meets-Experts averages it."""
    steps = max(100, _EVEN_ROWS // max(tokens, 1))
    picks = even_device_picks(num_experts, k, n, tokens, steps, _EVEN_SEED)
    busiest = picks.max(axis=-1)
    return float(np.mean(picks.mean(axis=-1) / busiest)), float(busiest.mean())


def kv_cache_bytes_per_token(cfg: ModelConfig, act_bytes: int = 2) -> int:
    """KV cache bytes one position of one request takes over every layer: what handing a
    prefilled request to a decode mesh moves per prompt token (`moejax.engine.disaggregated`)."""
    return act_bytes * sum(
        math.prod(shape) for layer in range(cfg.num_layers) for shape, _ in cache_specs(cfg, 1, 1, layer).values()
    )


def calc_report(cfg: ModelConfig, devices: list[int], tokens: int, touched: float | None, expert_format: str) -> dict:
    """The `moejax calc --json` document. `touched`: experts a step touches (None: the even router's
    expectation at `tokens`); expert bytes read per device assume they spread evenly over the devices."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    per_expert = expert_bytes(cfg)
    layers = len(cfg.moe_layers)
    touched_fraction = even_touched_fraction(e, k, tokens)
    touched_experts = touched_fraction * e if touched is None else touched
    rows = []
    for n in devices:
        balancedness, busiest = even_balance(e, k, n, tokens)
        rows.append(
            {
                "n": n,
                "devices_per_row": devices_per_row(e, k, n),
                "copies_sent_per_row": copies_sent_per_row(e, k, n),
                "copies_replicated": n - 1,
                "slice_width": slice_width(cfg.moe_intermediate_size, n),
                "even_touched_fraction": touched_fraction,
                "even_balancedness": balancedness,
                "even_busiest_picks": busiest,
                "expert_bytes_read_per_device": touched_experts * per_expert[expert_format] / n,
                # Two-batch overlap: each micro-batch of half the step's tokens reads the experts it
                # touches (an even router's), so a step reads them up to twice.
                "two_batch_expert_bytes_read_per_device": 2
                * even_touched_fraction(e, k, -(-tokens // 2))
                * e
                * per_expert[expert_format]
                / n,
            }
        )
    return {
        "expert_params": expert_params(cfg),
        "expert_bytes": per_expert,
        "layer_expert_bytes": {f: b * e for f, b in per_expert.items()},
        "model_expert_bytes": {f: b * e * layers for f, b in per_expert.items()},
        "row_bytes": row_bytes(cfg),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg),
        "devices": rows,
    }
