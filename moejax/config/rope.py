"""The rotary embedding a model computes, read from every shape a config writes it in.

Configs spell rope settings several ways: `rope_parameters` (transformers 5) or `rope_scaling`
(the releases: DeepSeek-V3/R1, Kimi-K2, gpt-oss, Qwen3), its kind under `rope_type` or `type`,
`rope_theta` and `partial_rotary_factor` at the top level or inside, `null` for none. `read_rope`
is the only reader of those dicts; the model (`model/layers.py`) and the attention scale
(`ModelConfig.softmax_scale`) consume the `Rope` it returns. Kinds moejax does not compute
(linear, dynamic, llama3, longrope, ...) are refused here, in one line.
"""

from __future__ import annotations

import dataclasses
import math

from moejax.config.errors import ConfigError

ROPE_TYPES = ("default", "yarn")
# YaRN's settings, as transformers' _compute_yarn_parameters and DeepSeek's reference read them.
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)
_NUMBERS = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    kind: str = "default"  # ROPE_TYPES
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: not given (DeepSeek's yarn names both mscales; gpt-oss's and Qwen's neither)
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: derived from factor and the mscales
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """yarn's attention factor, applied to cos and sin (1 without scaling)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def mla_softmax_factor(self) -> float:
        """DeepSeek's MLA multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim)^2."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def as_dict(self) -> dict | None:
        """The settings as a `rope_scaling` mapping `read_rope` reads back to this Rope (None: default)."""
        if self.kind == "default":
            return None
        d = {k: getattr(self, k) for k in YARN_KEYS}
        return {"rope_type": self.kind, **{k: v for k, v in d.items() if v is not None}}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(value, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}.{key} must be a number, got {value!r}")
    return float(value)


def _one(inside, outside, key: str, where: str) -> float | None:
    """A number given inside the rope mapping, at the top level, or both alike (None: neither)."""
    inside, outside = (None if v is None else _number(v, key, where) for v in (inside, outside))
    if inside is not None and outside is not None and inside != outside:
        raise ConfigError(f"{key} is {outside:g} at the top level but {inside:g} in {where}; give it once")
    return inside if inside is not None else outside


def read_rope(
    params: dict | None,
    theta=None,
    partial=None,
    max_position_embeddings: int = 0,
    where: str = "rope_scaling",
    default_theta: float = 10000.0,
    default_partial: float = 1.0,
) -> tuple[Rope, float]:
    """(Rope, partial_rotary_factor) from a rope mapping (`params`, None: no scaling) and the
    top-level `theta` and `partial` (None: not given). A yarn mapping without
    `original_max_position_embeddings` means `max_position_embeddings`, as transformers reads it."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where} must be a mapping or null, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where} holds per-layer-type rope settings, which moejax does not read")
    rest = dict(params)
    kinds = {rest.pop(k) for k in ("rope_type", "type") if k in rest}
    if len(kinds) > 1:
        raise ConfigError(f"{where} names two rope types, {' and '.join(map(repr, sorted(kinds, key=str)))}")
    kind = kinds.pop() if kinds else "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where} rope type {kind!r} is not computed by moejax (it computes {', '.join(ROPE_TYPES)})")
    theta = _one(rest.pop("rope_theta", None), theta, "rope_theta", where)
    partial = _one(rest.pop("partial_rotary_factor", None), partial, "partial_rotary_factor", where)
    theta = default_theta if theta is None else theta
    partial = default_partial if partial is None else partial
    allowed = YARN_KEYS if kind == "yarn" else ()
    unread = [k for k in rest if k not in allowed]
    if unread:
        raise ConfigError(
            f"{where} key {unread[0]!r} is not one rope type {kind!r} reads "
            f"({', '.join(allowed) or 'it reads none besides rope_theta and partial_rotary_factor'})"
        )
    if kind == "default":
        return Rope(theta=theta), partial
    return _yarn(rest, theta, max_position_embeddings, where), partial


def _yarn(d: dict, theta: float, max_position_embeddings: int, where: str) -> Rope:
    fields = {k: _number(d[k], k, where) for k in _NUMBERS if d.get(k) is not None}
    orig = d.get("original_max_position_embeddings") or max_position_embeddings
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise ConfigError(f"{where}.original_max_position_embeddings must be a positive integer, got {orig!r}")
    if "factor" not in fields:  # transformers: the ratio of the context lengths
        fields["factor"] = max_position_embeddings / orig
    truncate = d.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}.truncate must be true or false, got {truncate!r}")
    # beta_fast / beta_slow of 0 or null mean their defaults (32 and 1), as transformers reads them.
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        fields[key] = fields.get(key) or default
    return Rope(theta=theta, kind="yarn", original_max_position_embeddings=orig, truncate=truncate, **fields)
