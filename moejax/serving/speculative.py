"""Continuous batching with MTP speculative decoding (greedy requests).

The scheduler of `scheduler.py` with the MTP draft module of `moejax.engine.speculative`: the
MTP layer has a page pool of its own, read through the target's block tables (a request's pages
hold both), and each slot holds the MTP's draft of its next-but-one token. A decode step feeds every generating slot's
(token, draft) pair at (pos, pos + 1), accepts the draft when it equals the target's own greedy token, and emits one
or two tokens per slot; the MTP drafts
again inside the same step. A rejected draft's cache entries at pos + 1 are invisible to every
later query until overwritten (causal mask), as in the static speculative engine. A slot holds
the pages of every position a step writes (the MTP's reach pos + 2). No prefix cache: a cached
prefix lacks the MTP's entry just after it (written from its last position). With sliding-window
layers the target reads both page groups' tables (`paged.Tables`); the MTP layer, a full-attention
one, reads the full group's.

Greedy only: acceptance compares with the target's argmax, so tokens equal plain greedy decoding.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base.errors import UsageError
from moejax.engine.host import to_host
from moejax.engine.programs import jit_program
from moejax.model import paged
from moejax.model.mtp import init_mtp_pool, mtp_forward
from moejax.model.transformer import forward, lm_head
from moejax.serving.scheduler import Request, Scheduler
from moejax.serving.step_plan import Call


def _greedy(params, h, c):
    return jnp.argmax(lm_head(params, h, c), axis=-1).astype(jnp.int32)


def _zero_first(mtp_cache: dict, pages: jax.Array, start: jax.Array, placement) -> dict:
    """The MTP writes from position 1 on: rows starting a request (start 0) set its position 0 to
    zeros, what a fresh contiguous cache reads there (a page from the pool holds what it held)."""
    far = jnp.iinfo(jnp.int32).max // 2  # past every table: the write is dropped
    positions = jnp.where(start == 0, 0, far)[:, None]  # [P, 1]
    out = {}
    for name, pool in mtp_cache.items():  # [N, H, ps, Dh] or [N, ps, R]
        seq_axis = pool.ndim - 2
        rest = pool.shape[1:seq_axis] + pool.shape[seq_axis + 1 :]
        out[name] = placement.store_pages(
            pool, jnp.zeros((start.shape[0], 1, *rest), pool.dtype), positions, pages, seq_axis, view=False
        )
    return out


def spec_prefill_slots(params, mtp, cache, mtp_cache, pages, tokens, start, last, after, *, c, placement):
    """One prefill chunk of P requests, target and MTP. tokens: [P, C]; pages: block tables [P, W];
    start, last: [P]; after: [P] the seq token following the chunk (unused in a request's last
    chunk). -> (first new token [P], its draft successor [P], cache, mtp_cache); meaningful where
    `last` falls in this chunk."""
    p, chunk = tokens.shape
    positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    h, cache, _ = forward(params, cache, tokens, positions, c, placement, pages=pages)
    pages = pages.full if isinstance(pages, paged.Tables) else pages  # the MTP layer's group
    at_last = (jnp.arange(p), jnp.clip(last - start, 0, chunk - 1))
    first = _greedy(params, h[at_last], c)
    # The MTP sees (hidden at i, token at i + 1) at position i + 1.
    following = jnp.concatenate([tokens[:, 1:], after[:, None]], axis=1)
    following = jnp.where(positions == last[:, None], first[:, None], following)
    mh, mtp_cache = mtp_forward(
        mtp, params, _zero_first(mtp_cache, pages, start, placement), h, following, positions + 1, c, placement, pages
    )
    draft = _greedy(params, mh[at_last], c)
    return first, draft, cache, mtp_cache


def spec_decode_slots(params, mtp, cache, mtp_cache, pages, token, draft, pos, *, c, placement):
    """One speculative step over W rows with block tables pages [W, P]: token at pos, draft for
    pos + 1 (each [W]) -> (emitted [W, 2], accepted [W], next draft [W], cache, mtp_cache). A
    slot's new tokens are emitted[:1 + accepted]."""
    rows = jnp.arange(token.shape[0])
    positions = pos[:, None] + jnp.arange(2, dtype=jnp.int32)  # [W, 2]
    h, cache, _ = forward(params, cache, jnp.stack([token, draft], axis=1), positions, c, placement, pages=pages)
    target = _greedy(params, h, c)  # [W, 2]: the tokens after `token` and after `draft`
    accepted = target[:, 0] == draft
    pages = pages.full if isinstance(pages, paged.Tables) else pages  # the MTP layer's group
    mh, mtp_cache = mtp_forward(mtp, params, mtp_cache, h, target, positions + 1, c, placement, pages)
    n = accepted.astype(jnp.int32)
    next_draft = _greedy(params, mh[rows, n], c)
    return target, accepted, next_draft, cache, mtp_cache


class SpecScheduler(Scheduler):
    writes_per_step = 3  # the target at pos and pos + 1, the MTP at pos + 1 and pos + 2
    mtp_pool = True

    def __init__(self, engine, mtp: dict, prefix_cache: bool = True, **kw):
        super().__init__(engine, prefix_cache=False, **kw)
        if prefix_cache:
            self.notes.append("the prefix cache is off with MTP drafts (--no-prefix-cache is implied)")
        self.mtp = mtp
        c = engine.c
        self.mtp_cache = engine.placement.zeros_cache(
            lambda: [init_mtp_pool(c, self.kv.num_pages, self.kv.page_size, engine.dtype)], pool=True
        )[0]
        self.drafts = self.accepted = 0  # drafts checked and accepted (acceptance rate)
        bind = dict(c=c, placement=engine.placement)
        self._spec_prefill = jit_program(
            functools.partial(spec_prefill_slots, **bind),
            engine.dtype,
            engine.placement.platform,
            donate_argnums=(2, 3),
        )
        self._spec_decode = jit_program(
            functools.partial(spec_decode_slots, **bind),
            engine.dtype,
            engine.placement.platform,
            decode=True,
            donate_argnums=(2, 3),
        )

    def check(self, request: Request) -> None:
        super().check(request)
        if request.temperature > 0:
            raise UsageError("this server decodes with MTP drafts, greedy only: send temperature 0")
        if request.extras or request.samples or request.echo_logprobs or request.max_tokens < 1:
            raise UsageError(
                "this server decodes with MTP drafts: logprobs, logit_bias, min_tokens, n > 1 and "
                "max_tokens 0 are served without --speculative only"
            )

    def _decode_step(self, decoding: list[int]) -> None:
        width, row = self._decode_rows(decoding)
        at = {i: s for s, i in row.items()}  # row -> slot
        token, draft = np.zeros(width, np.int32), np.zeros(width, np.int32)
        pos = np.full(width, self.max_len, np.int32)  # idle: no pages, writes dropped
        for s in decoding:
            token[row[s]], draft[row[s]], pos[row[s]] = self.slots[s].token, self.slots[s].draft, self.slots[s].pos
        reach = max(self.slots[s].pos + self.writes_per_step for s in decoding)
        pages = self.kv.table([self.slots[at[i]].pages if i in at else [] for i in range(width)], width, reach)
        window = self._window_table([at.get(i) for i in range(width)], reach)
        emitted, accepted, next_draft = self._run(
            Call("spec_decode", dict(pages=pages, **window, token=token, draft=draft, pos=pos))
        )
        now = time.perf_counter()
        for s in decoding:
            slot, n = self.slots[s], int(accepted[row[s]])
            self.drafts, self.accepted = self.drafts + 1, self.accepted + n
            slot.draft = int(next_draft[row[s]])
            for j in range(1 + n):
                slot.pos += 1
                self._emit(s, int(emitted[row[s], j]), now)
                if self.slots[s] is None:  # stopped: the second token is not its
                    break

    def _prefill_call(self, rows: list[int]) -> None:
        pages, tokens, start, last, after, _ = self._prefill_inputs(rows, reach=1)
        window = self._window_table(rows, int(start.max()) + self.chunk + 1)
        first, draft = self._run(
            Call("spec_prefill", dict(pages=pages, **window, tokens=tokens, start=start, last=last, after=after))
        )
        now = time.perf_counter()
        for i, s in self._advance_prefill(rows, self.chunk):
            self.slots[s].draft = int(draft[i])
            self._start_decoding(s, int(first[i]), now)

    def _do_spec_decode(self, a: dict):
        """-> (emitted [W, 2], accepted [W], next draft [W])."""
        emitted, accepted, next_draft, self.cache, self.mtp_cache = self._spec_decode(
            self.engine.params, self.mtp, self.cache, self.mtp_cache, self._tables(a), a["token"], a["draft"], a["pos"]
        )
        return to_host(emitted), to_host(accepted), to_host(next_draft)

    def _do_spec_prefill(self, a: dict):
        """-> (first new token [P], its draft [P])."""
        first, draft, self.cache, self.mtp_cache = self._spec_prefill(
            self.engine.params,
            self.mtp,
            self.cache,
            self.mtp_cache,
            self._tables(a),
            a["tokens"],
            a["start"],
            a["last"],
            a["after"],
        )
        return to_host(first), to_host(draft)

    def warm_up(self) -> None:
        p = self.prefill_rows
        for pw in self.kv.widths():
            for w in self.decode_widths():
                zeros = np.zeros(w, np.int32)
                *_, self.cache, self.mtp_cache = self._spec_decode(
                    self.engine.params,
                    self.mtp,
                    self.cache,
                    self.mtp_cache,
                    self._idle(w, pw),
                    zeros,
                    zeros,
                    np.full(w, self.max_len, np.int32),
                )
            zeros = np.zeros(p, np.int32)
            first, _, self.cache, self.mtp_cache = self._spec_prefill(
                self.engine.params,
                self.mtp,
                self.cache,
                self.mtp_cache,
                self._idle(p, pw),
                np.zeros((p, self.chunk), np.int32),
                zeros,
                zeros,
                zeros,
            )
            first.block_until_ready()
