"""MTP speculative decoding: one jitted step per decode step, no host round trip between steps.

State per request: the next token (at `pos`, emitted, not yet through the target) and the MTP's
draft for `pos + 1`. A step runs the target on both (two rows per request), accepts or rejects
the draft on the device, and lets the MTP draft the next token inside the same step (Decode-Anatomy's
device-side rejection and early draft). Rollback of a rejected draft costs nothing: its cache
slot (target and MTP) holds keys at `pos + 1` that no query at or before `pos + 1` of the next
step can see through the causal mask before the next step overwrites them.

Greedy: the draft is accepted when it equals the target's argmax, so the tokens equal plain
greedy decoding. Sampled: standard speculative sampling (accept with min(1, p/q), else draw from
norm(max(p - q, 0))), so tokens are distributed as the target's own samples.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base.errors import UsageError
from moejax.engine import compile_clock
from moejax.engine.buckets import MIN_POSITIONS, bucket
from moejax.engine.engine import Engine
from moejax.engine.host import seed_rows, to_host
from moejax.engine.programs import jit_program
from moejax.engine.sampling import Sampling, draw, row_keys, sample, sampling_logits
from moejax.model.mtp import init_mtp_cache, mtp_forward
from moejax.model.transformer import forward, lm_head

STOP_CHECK = 4  # steps between the host's reads of the emitted-token counts
# What a row's key at a position is folded with for a draft and for a verification: apart from
# the key that draws the target's own token there (`sample`).
DRAFT, VERIFY = 1, 2


def keys_for(seeds: jax.Array, positions: jax.Array, use: int) -> jax.Array:
    """Keys [B] of the rows' seeds [B] at positions [B] for one use (DRAFT, VERIFY)."""
    return jax.vmap(jax.random.fold_in, (0, None))(row_keys(seeds, positions), use)


class SpecState(NamedTuple):
    """On the device between steps; [B] unless noted."""

    token: jax.Array  # int32: the next token, at `pos`
    draft: jax.Array  # int32: the MTP's guess for pos + 1
    draft_probs: jax.Array  # float32 [B, V] the distribution the draft was drawn from ([B, 1] greedy)
    pos: jax.Array  # int32
    count: jax.Array  # int32: tokens emitted so far (the host's stop test reads it)
    seeds: jax.Array  # int32: each row's sampling seed


def draft_from(logits: jax.Array, keys: jax.Array, s: Sampling) -> tuple[jax.Array, jax.Array]:
    """MTP logits [B, V], keys [B] -> (draft [B], the distribution it was drawn from)."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros((logits.shape[0], 1), jnp.float32)
    masked = sampling_logits(logits, s)
    return draw(keys, masked), jax.nn.softmax(masked, axis=-1)


def verify(logits: jax.Array, draft: jax.Array, q: jax.Array, keys: jax.Array, s: Sampling):
    """The token after the target's logits [B, V]: (accepted [B], token [B]) where token is the
    draft when accepted, else a replacement; distributed exactly as `sample(logits)`. keys: [B]."""
    if s.greedy:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return token == draft, token
    p = jax.nn.softmax(sampling_logits(logits, s), axis=-1)
    k_accept, k_replace = jax.vmap(jax.random.split, out_axes=1)(keys)
    p_draft = jnp.take_along_axis(p, draft[:, None], axis=-1)[:, 0]
    q_draft = jnp.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    accepted = jax.vmap(jax.random.uniform)(k_accept) * q_draft < p_draft  # u < p/q without dividing
    # Rejection implies p(draft) < q(draft), so the residual has mass elsewhere.
    replacement = draw(k_replace, jnp.log(jnp.maximum(p - q, 0.0)))
    return accepted, jnp.where(accepted, draft, replacement)


def spec_prefill(params, mtp, cache, mtp_cache, tokens, last, seeds, *, c, placement, sampling: Sampling):
    """tokens: [B, W] padded prompts, last: [B] last prompt positions, seeds: [B] -> (state, cache,
    mtp_cache). The first new token is drawn as `Engine.generate` draws it.

    The MTP sees (hidden at i, token i + 1) at positions i + 1: the prompt shifted by one, with
    the first new token after each prompt's last position."""
    b, w = tokens.shape
    rows = jnp.arange(b)
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    h, cache, _ = forward(params, cache, tokens, positions, c, placement)
    first = sample(lm_head(params, h[rows, last], c), sampling, seeds, last + 1)
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    following = jnp.where(positions == last[:, None], first[:, None], following)
    mh, mtp_cache = mtp_forward(mtp, params, mtp_cache, h, following, positions + 1, c, placement)
    draft, q = draft_from(lm_head(params, mh[rows, last], c), keys_for(seeds, last + 2, DRAFT), sampling)
    return SpecState(first, draft, q, last + 1, jnp.ones_like(last), seeds), cache, mtp_cache


def spec_step(params, mtp, cache, mtp_cache, state: SpecState, *, c, placement, sampling: Sampling):
    """One speculative decode step -> (state, cache, mtp_cache, emitted int32 [B, 2], accepted [B]).
    The step's new tokens are emitted[:, :1 + accepted]."""
    rows = jnp.arange(state.token.shape[0])
    positions = state.pos[:, None] + jnp.arange(2, dtype=jnp.int32)  # [B, 2]: next token, draft
    h, cache, _ = forward(params, cache, jnp.stack([state.token, state.draft], axis=1), positions, c, placement)
    logits = lm_head(params, h, c)  # [B, 2, V]
    seeds = state.seeds
    accepted, token = verify(
        logits[:, 0], state.draft, state.draft_probs, keys_for(seeds, state.pos + 1, VERIFY), sampling
    )
    bonus = sample(logits[:, 1], sampling, seeds, state.pos + 2)  # kept after an accepted draft
    emitted = jnp.stack([token, bonus], axis=1)
    # Both MTP rows run: row 0 drafts pos + 2 (after a rejection), row 1 drafts pos + 3 (after an
    # acceptance, when its cache entry at pos + 2 is needed too); the unused row's entry is stale.
    mh, mtp_cache = mtp_forward(mtp, params, mtp_cache, h, emitted, positions + 1, c, placement)
    n = accepted.astype(jnp.int32)
    draft, q = draft_from(lm_head(params, mh[rows, n], c), keys_for(seeds, state.pos + 2 + n, DRAFT), sampling)
    state = SpecState(emitted[rows, n], draft, q, state.pos + 1 + n, state.count + 1 + n, seeds)
    return state, cache, mtp_cache, emitted, accepted


@dataclasses.dataclass
class SpecGeneration:
    tokens: list[list[int]]
    finish_reasons: list[str]
    acceptance_rate: float  # accepted drafts / steps, over the steps each request still needed
    steps: int  # speculative steps run (after the prefill)
    prefill_ms: float  # wall times less compiling, as Generation's
    step_ms: float  # mean of one speculative step
    # Prefill and decode on their own engines (`disaggregated.py`): the caches' hand-over.
    handover_bytes: int = 0
    handover_ms: float = 0.0


@dataclasses.dataclass
class SpecPrefilled:
    """A batch after its speculative prefill: what speculative decoding continues from."""

    prompts: list[list[int]]
    state: SpecState
    cache: list[dict]  # the target's, per run of layers, max_len positions
    mtp_cache: dict  # the MTP layer's
    first: np.ndarray  # [B] the first new tokens, on the host
    max_len: int
    written: int  # target cache positions [0, written) the prefill wrote; the MTP's run one further (positions + 1)
    prefill_ms: float


class SpeculativeEngine:
    """A target `Engine` plus an MTP draft module, with jitted prefill and step."""

    def __init__(self, engine: Engine, mtp: dict):
        self.engine, self.mtp = engine, mtp
        self.placement = engine.placement
        bind = dict(c=engine.c, placement=engine.placement)
        self._prefill = jit_program(
            functools.partial(spec_prefill, **bind),
            engine.dtype,
            engine.placement.platform,
            donate_argnums=(2, 3),
            static_argnames="sampling",
        )
        self._step = jit_program(
            functools.partial(spec_step, **bind),
            engine.dtype,
            engine.placement.platform,
            decode=True,
            donate_argnums=(2, 3),
            static_argnames="sampling",
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0
    ) -> SpecGeneration:
        return self.decode(self.start(prompts, max_new_tokens, sampling, seed), max_new_tokens, sampling)

    def start(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        seed: int = 0,
        batch_multiple: int | None = None,
    ) -> SpecPrefilled:
        """Prefill target and MTP, with the first tokens and drafts. `batch_multiple`: as `Engine.start`'s."""
        e = self.engine
        e.check_prompts(prompts)
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        longest = max(map(len, prompts))
        if longest + max_new_tokens > e.c.max_position_embeddings:
            raise UsageError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's context "
                f"of {e.c.max_position_embeddings}"
            )
        tokens, lens = e._padded(prompts, batch_multiple)
        # One slot beyond the last token for the final step's draft row.
        max_len = e.config.engine.max_seq_len or bucket(
            max(tokens.shape[1], longest + max_new_tokens + 1), MIN_POSITIONS
        )
        if longest >= max_len:
            raise UsageError(f"prompt of {longest} tokens does not fit the KV cache of {max_len} positions")
        batch = tokens.shape[0]
        cache = e.new_cache(batch, max_len)
        mtp_cache = e.placement.zeros_cache(lambda: [init_mtp_cache(e.c, batch, max_len, e.dtype)])[0]
        t0 = compile_clock.now()
        state, cache, mtp_cache = self._prefill(
            e.params,
            self.mtp,
            cache,
            mtp_cache,
            jnp.asarray(tokens),
            jnp.asarray(lens - 1),
            seed_rows(seed, len(lens)),
            sampling=sampling,
        )
        # The counts placed as a step leaves them: the first step runs the later steps' program.
        state = state._replace(count=e._as_decoded(state.count))
        first = to_host(state.token)  # waits for the prefill (its timing)
        t1 = compile_clock.now()
        return SpecPrefilled(
            prompts, state, cache, mtp_cache, first, max_len, tokens.shape[1], compile_clock.run_ms(t0, t1)
        )

    def decode(self, prefilled: SpecPrefilled, max_new_tokens: int, sampling: Sampling = Sampling()) -> SpecGeneration:
        """Speculative steps from `prefilled` (this engine's prefill, or another's handed over)."""
        prompts, state, cache, mtp_cache = prefilled.prompts, prefilled.state, prefilled.cache, prefilled.mtp_cache
        budget = np.array([min(max_new_tokens, prefilled.max_len - len(p) + 1) for p in prompts])
        t1 = compile_clock.now()
        emitted, accepted, before = [], [], state.count
        for step in range(max_new_tokens - 1):
            state, cache, mtp_cache, out, acc = self._step(
                self.engine.params, self.mtp, cache, mtp_cache, state, sampling=sampling
            )
            emitted.append(out)
            accepted.append(acc)
            # Stop when every request has its tokens. The counts read are those from before the
            # step just dispatched, so the device never idles waiting for the host; read every
            # STOP_CHECK steps only, to keep transfers off most step boundaries.
            if step % STOP_CHECK == STOP_CHECK - 1 and to_host(before)[: len(prompts)].min() >= budget.max():
                break
            before = state.count
        jax.block_until_ready(state.token)
        t2 = compile_clock.now()
        return self._collect(
            prompts, budget, prefilled.first, emitted, accepted, prefilled.prefill_ms, compile_clock.run_ms(t1, t2)
        )

    @staticmethod
    def _collect(prompts, budget, first, emitted, accepted, prefill_ms, decode_ms) -> SpecGeneration:
        emitted = to_host(jnp.stack(emitted)) if emitted else np.zeros((0, len(first), 2), np.int32)
        accepted = to_host(jnp.stack(accepted)) if accepted else np.zeros((0, len(first)), bool)
        tokens, drafts_accepted, active_steps = [], 0, 0
        for i in range(len(prompts)):
            out = [int(first[i])]
            for s in range(len(emitted)):
                if len(out) >= budget[i]:
                    break
                active_steps += 1
                drafts_accepted += int(accepted[s, i])
                out.extend(emitted[s, i, : 1 + int(accepted[s, i])].tolist())
            tokens.append(out[: budget[i]])
        return SpecGeneration(
            tokens=tokens,
            finish_reasons=["length"] * len(prompts),
            acceptance_rate=drafts_accepted / max(1, active_steps),
            steps=len(emitted),
            prefill_ms=prefill_ms,
            step_ms=decode_ms / max(1, len(emitted)),
        )
