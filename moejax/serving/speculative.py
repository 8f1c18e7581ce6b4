"""Continuous batching with MTP speculative decoding (greedy requests).

The scheduler of `scheduler.py` with the MTP draft module of `moejax.engine.speculative`: each
slot also holds a row of the MTP's own KV cache and the MTP's draft of its next-but-one token. A
decode step feeds every generating slot's (token, draft) pair at (pos, pos + 1), accepts the draft
when it equals the target's own greedy token, and emits one or two tokens per slot; the MTP drafts
again inside the same step. A rejected draft's cache entries at pos + 1 are invisible to every
later query until overwritten (causal mask), as in the static speculative engine.

Greedy only: acceptance compares with the target's argmax, so tokens equal plain greedy decoding.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.engine.engine import to_host
from moejax.errors import UsageError
from moejax.model.mtp import init_mtp_cache, mtp_forward
from moejax.model.transformer import forward, lm_head
from moejax.serving.scheduler import Request, Scheduler
from moejax.serving.slot_programs import put_rows, take_rows


def _greedy(params, h, c):
    return jnp.argmax(lm_head(params, h, c), axis=-1).astype(jnp.int32)


def spec_prefill_slots(params, mtp, cache, mtp_cache, slots, tokens, start, last, after, *, c, placement):
    """One prefill chunk of P requests, target and MTP. tokens: [P, C]; slots, start, last: [P];
    after: [P] the prompt token following the chunk (unused in a request's last chunk).
    -> (first new token [P], its draft successor [P], cache, mtp_cache); meaningful where `last`
    falls in this chunk."""
    p, chunk = tokens.shape
    positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    h, rows, _ = forward(params, take_rows(cache, slots), tokens, positions, c, placement)
    at_last = (jnp.arange(p), jnp.clip(last - start, 0, chunk - 1))
    first = _greedy(params, h[at_last], c)
    # The MTP sees (hidden at i, token at i + 1) at position i + 1.
    following = jnp.concatenate([tokens[:, 1:], after[:, None]], axis=1)
    following = jnp.where(positions == last[:, None], first[:, None], following)
    (mtp_rows,) = take_rows([mtp_cache], slots, axis=0)
    mh, mtp_rows = mtp_forward(mtp, params, mtp_rows, h, following, positions + 1, c, placement)
    draft = _greedy(params, mh[at_last], c)
    return first, draft, put_rows(cache, slots, rows), put_rows([mtp_cache], slots, [mtp_rows], axis=0)[0]


def spec_decode_slots(params, mtp, cache, mtp_cache, slots, token, draft, pos, *, c, placement):
    """One speculative step over slots [W]: token at pos, draft for pos + 1 (each [W]) ->
    (emitted [W, 2], accepted [W], next draft [W], cache, mtp_cache). A slot's new tokens are
    emitted[:1 + accepted]."""
    rows = jnp.arange(token.shape[0])
    positions = pos[:, None] + jnp.arange(2, dtype=jnp.int32)  # [W, 2]
    h, cache_rows, _ = forward(params, take_rows(cache, slots), jnp.stack([token, draft], axis=1), positions, c,
                               placement)
    target = _greedy(params, h, c)  # [W, 2]: the tokens after `token` and after `draft`
    accepted = target[:, 0] == draft
    (mtp_rows,) = take_rows([mtp_cache], slots, axis=0)
    mh, mtp_rows = mtp_forward(mtp, params, mtp_rows, h, target, positions + 1, c, placement)
    n = accepted.astype(jnp.int32)
    next_draft = _greedy(params, mh[rows, n], c)
    return (target, accepted, next_draft, put_rows(cache, slots, cache_rows),
            put_rows([mtp_cache], slots, [mtp_rows], axis=0)[0])


class SpecScheduler(Scheduler):
    def __init__(self, engine, mtp: dict, **kw):
        super().__init__(engine, **kw)
        self.mtp = mtp
        c = engine.c
        self.mtp_cache = engine.placement.place_cache([init_mtp_cache(c, self.num_slots, self.max_len, engine.dtype)])[0]
        self.drafts = self.accepted = 0  # drafts checked and accepted (acceptance rate)
        bind = dict(c=c, placement=engine.placement)
        self._spec_prefill = jax.jit(functools.partial(spec_prefill_slots, **bind), donate_argnums=(2, 3))
        self._spec_decode = jax.jit(functools.partial(spec_decode_slots, **bind), donate_argnums=(2, 3))

    def check(self, request: Request) -> None:
        super().check(request)
        if request.temperature > 0:
            raise UsageError("this server decodes with MTP drafts, greedy only: send temperature 0")
        if request.extras or request.samples or request.echo_logprobs or request.max_tokens < 1:
            raise UsageError("this server decodes with MTP drafts: logprobs, logit_bias, min_tokens, n > 1 and "
                             "max_tokens 0 are served without --speculative only")

    def _decode_step(self, decoding: list[int]) -> None:
        width = min(w for w in self.decode_widths() if w > max(decoding))
        token, draft = np.zeros(width, np.int32), np.zeros(width, np.int32)
        pos = np.full(width, self.max_len, np.int32)  # idle: writes dropped
        for s in decoding:
            token[s], draft[s], pos[s] = self.slots[s].token, self.slots[s].draft, self.slots[s].pos
        emitted, accepted, next_draft, self.cache, self.mtp_cache = self._spec_decode(
            self.engine.params, self.mtp, self.cache, self.mtp_cache, np.arange(width, dtype=np.int32), token, draft, pos)
        emitted, accepted, next_draft = to_host(emitted), to_host(accepted), to_host(next_draft)
        now = time.perf_counter()
        for s in decoding:
            slot, n = self.slots[s], int(accepted[s])
            self.drafts, self.accepted = self.drafts + 1, self.accepted + n
            slot.draft = int(next_draft[s])
            for j in range(1 + n):
                slot.pos += 1
                self._emit(s, int(emitted[s, j]), now)
                if self.slots[s] is None:  # stopped: the second token is not its
                    break

    def _prefill_call(self, rows: list[int]) -> None:
        p, c = self.prefill_rows, self.chunk
        slots = np.full(p, self.num_slots, np.int32)
        tokens = np.zeros((p, c), np.int32)
        start, last, after = np.zeros(p, np.int32), np.zeros(p, np.int32), np.zeros(p, np.int32)
        for i, s in enumerate(rows):
            prompt, done = self.slots[s].request.prompt, self.slots[s].done
            piece = prompt[done : done + c]
            slots[i], start[i], last[i] = s, done, len(prompt) - 1
            tokens[i, : len(piece)] = piece
            after[i] = prompt[done + c] if done + c < len(prompt) else 0
        self.prefilled_tokens += sum(min(c, len(self.slots[s].request.prompt) - self.slots[s].done) for s in rows)
        first, draft, self.cache, self.mtp_cache = self._spec_prefill(
            self.engine.params, self.mtp, self.cache, self.mtp_cache, slots, tokens, start, last, after)
        first, draft = to_host(first), to_host(draft)
        now = time.perf_counter()
        for i, s in self._advance_prefill(rows, c):
            slot = self.slots[s]
            slot.pos, slot.draft = slot.done, int(draft[i])
            self._emit(s, int(first[i]), now)

    def warm_up(self) -> None:
        p, n = self.prefill_rows, self.num_slots
        for w in self.decode_widths():
            zeros = np.zeros(w, np.int32)
            *_, self.cache, self.mtp_cache = self._spec_decode(
                self.engine.params, self.mtp, self.cache, self.mtp_cache, np.arange(w, dtype=np.int32), zeros, zeros,
                np.full(w, self.max_len, np.int32))
        zeros = np.zeros(p, np.int32)
        first, _, self.cache, self.mtp_cache = self._spec_prefill(
            self.engine.params, self.mtp, self.cache, self.mtp_cache, np.full(p, n, np.int32),
            np.zeros((p, self.chunk), np.int32), zeros, zeros, zeros)
        first.block_until_ready()
