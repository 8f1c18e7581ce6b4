"""The engine: a model, its placed parameters and a placement bound to jitted programs
(`programs.py`), and the host-side generation loop over them.

Shapes are bucketed (`buckets.py`), so a new request mix recompiles only when a bucket changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base.errors import UsageError
from moejax.config import Config
from moejax.engine import compile_clock
from moejax.engine.buckets import MIN_POSITIONS, bucket, decode_visible
from moejax.engine.host import forced, seed_rows, to_host
from moejax.engine.kv_cache import init_cache, init_pool
from moejax.engine.pages import PageAllocator, pages_for
from moejax.engine.programs import step_programs
from moejax.engine.routing import Routing, valid_rows
from moejax.engine.sampling import Sampling, sample
from moejax.model import paged
from moejax.model.layer_loop import arrange


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per request
    finish_reasons: list[str]  # "length" when the cache or max_new_tokens ended the request
    picks: list | None = None  # per forward pass: [layers, rows, k] router picks (record=True)
    logits: np.ndarray | None = None  # [steps, B, V] logits each new token was chosen from
    # Wall times less the time spent compiling (see compile_clock), so a first run reports run time.
    prefill_ms: float = 0.0  # the whole prefill (all chunks) and the first token
    decode_step_ms: float = 0.0  # mean of one decode step
    # Prefill and decode on their own engines (`disaggregated.py`): the KV cache's hand-over.
    handover_bytes: int = 0  # cache bytes that changed device
    handover_ms: float = 0.0


@dataclasses.dataclass
class Prefilled:
    """A batch after its prefill and first token: what decoding continues from."""

    prompts: list[list[int]]
    cache: list[dict]  # per run of layers, arrays [layers, B, ...] of max_len positions
    tok: jax.Array  # [B] the first new tokens
    logits: jax.Array  # [B, V] the logits they were chosen from
    lens: np.ndarray  # [B] prompt lengths: each request's next position
    max_len: int
    written: int  # cache positions [0, written) the prefill wrote (the padded prompts' width); the rest are zeros
    seeds: np.ndarray  # [B] each row's sampling seed
    dealer: object  # the routing override's state (`Routing.start`), which decoding continues
    picks: list
    prefill_ms: float
    pages: jax.Array | None = None  # a paged cache's block tables [B, P] (cache: page pools), else None


class Engine:
    """Binds a model, its (placed) parameters and a placement to jitted prefill/decode, under a
    routing override (`engine.routing`; default the router's own picks)."""

    def __init__(
        self,
        config: Config,
        params: dict,
        placement,
        routing: Routing = Routing(),
        phy2log=None,
        arranged: bool = False,
    ):
        """`params` with every run stacked, or `arranged` already for this placement's loops
        (loaded with them, or another engine's, lent)."""
        self.config = config
        self.phy2log = phy2log  # int[MoE layers, slots]: the experts' placement (None: checkpoint order)
        self.c = config.model
        self.loops = placement.loops  # each run of layers: scanned or unrolled (`layer_loop.py`)
        self.params = params if arranged else arrange(params, self.loops)
        self.placement = placement
        routing.check(self.c)
        self.routing = routing
        self.dtype = jnp.dtype(placement.platform.run_dtype(config.engine.dtype))
        compile_clock.start()
        self.max_chunk = config.engine.prefill_chunk or placement.platform.prefill_chunk
        self._prefill, self._decode, self._decode_block = step_programs(self.c, placement, self.dtype)
        self.decode_block = config.engine.decode_block  # `moejax trace` sets 1: a program per step
        # The first tokens placed as a decode step leaves its own (rows over the batch axis): the
        # first step then runs the program every later step runs, rather than compiling its own.
        self._as_decoded = jax.jit(lambda tok: placement.constrain(tok, ("batch",)))

    # ------------------------------------------------------------------ helpers
    def check_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts:
            raise UsageError("no prompts given")
        for i, p in enumerate(prompts):
            if not p:
                raise UsageError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.c.vocab_size]
            if bad:
                raise UsageError(f"prompt {i} has token id {bad[0]} outside the vocabulary 0..{self.c.vocab_size - 1}")

    def new_cache(self, batch: int, max_len: int) -> list[dict]:
        return self.placement.zeros_cache(lambda: init_cache(self.c, batch, max_len, self.dtype))

    def new_pool(self, pages: int, page_size: int, window_pages: int = 0) -> list[dict]:
        """A page pool in the layout the attention kernel reads (and, with sliding-window layers,
        their own pool of `window_pages`). Under DP attention each rank holds an equal share of
        the pages, and its requests' tables name only those (every device reads and writes its
        own: `store_pages`, `on_pages`)."""
        return self.placement.zeros_cache(
            lambda: init_pool(self.c, pages, page_size, self.dtype, self.placement.attention_kernel, window_pages),
            pool=True,
        )

    def _paged_cache(self, batch: int, max_len: int):
        """engine.page_size: a pool of pages for `batch` rows of `max_len` positions and their
        block tables [batch, max_len / page_size], handed out by the allocator as a server's would:
        under DP attention each rank's rows from the rank's own share of the pool."""
        ps = self.config.engine.page_size
        per_row = pages_for(max_len, ps)
        ranks = self.placement.batch_multiple()
        share = batch // ranks * per_row  # pages of a rank: rows i * ranks // batch == rank
        allocators = [PageAllocator(share, ps) for _ in range(ranks)]
        rows = [[] for _ in range(batch)]
        for _ in range(per_row):  # a page per row in turn, as rows grow: every table names scattered pages
            for i, row in enumerate(rows):
                rank = i * ranks // batch
                row += [rank * share + page for page in allocators[rank].allocate(1)]
        table = jnp.asarray(np.asarray(rows, np.int32))
        if self.c.sliding_layers:  # the window group: as many pages, the same tables (nothing freed here)
            return self.new_pool(ranks * share, ps, ranks * share), paged.Tables(table, table)
        return self.new_pool(ranks * share, ps), table

    def chunk_for(self, prompts: list[list[int]]) -> int:
        """Positions per prefill call for these prompts: the longest prompt's power-of-two bucket
        (at least MIN_POSITIONS), so short prompts are not padded to a whole large chunk, up to max_chunk."""
        return min(self.max_chunk, bucket(max(map(len, prompts)), MIN_POSITIONS))

    def _padded(self, prompts: list[list[int]], multiple: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        chunk = self.chunk_for(prompts)
        multiple = multiple or self.placement.batch_multiple()
        batch = -(-bucket(len(prompts)) // multiple) * multiple
        width = -(-max(map(len, prompts)) // chunk) * chunk
        tokens = np.zeros((batch, width), np.int32)
        lens = np.ones(batch, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            lens[i] = len(p)
        return tokens, lens

    def _run_prefill(
        self,
        cache,
        tokens: np.ndarray,
        lens: np.ndarray,
        all_logits: bool,
        record: bool,
        dealer,
        prompt_lens: list[int],
        pages=None,
    ):
        chunk = min(self.max_chunk, tokens.shape[1])  # _padded's width: one bucket, or whole max chunks
        last = jnp.asarray(lens - 1)
        outs, picks = [], []
        # every contiguous entry's positions precede one last axis
        cache_len = (
            jax.tree.leaves(cache)[0].shape[-2] if pages is None else paged.page_size_of(cache) * paged.width(pages)
        )
        for start in range(0, tokens.shape[1], chunk):
            valid = valid_rows(prompt_lens, tokens.shape[0], chunk, start)
            # Attention over the positions this chunk can see, not the whole cache; in buckets,
            # so that the programs stay few.
            visible = bucket(start + chunk, MIN_POSITIONS)
            logits, cache, p = self._prefill(
                self.params,
                cache,
                jnp.asarray(tokens[:, start : start + chunk]),
                jnp.int32(start),
                last,
                forced(dealer, "prefill", valid),
                pages,
                all_logits=all_logits,
                record=record,
                visible=visible if visible < cache_len else 0,
            )
            outs.append(logits)
            picks.append(p)
        if all_logits:
            return jnp.concatenate(outs, axis=1), cache, picks
        in_chunk = [(lens - 1) // chunk == i for i in range(len(outs))]
        logits = sum(jnp.where(m[:, None], o, 0.0) for m, o in zip(in_chunk, outs))
        return logits, cache, picks

    # ------------------------------------------------------------------ public
    def score(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Logits [len(prompt), V] of one prefill, per request."""
        self.check_prompts(prompts)
        tokens, lens = self._padded(prompts)
        cache = self.new_cache(tokens.shape[0], bucket(tokens.shape[1], MIN_POSITIONS))
        logits, _, _ = self._run_prefill(
            cache,
            tokens,
            lens,
            all_logits=True,
            record=False,
            dealer=self.routing.start(self.c),
            prompt_lens=[len(p) for p in prompts],
        )
        logits = to_host(logits)
        return [logits[i, : len(p)] for i, p in enumerate(prompts)]

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        seed: int = 0,
        record: bool = False,
        return_logits: bool = False,
    ) -> Generation:
        return self.decode(
            self.start(prompts, max_new_tokens, sampling, seed, record), max_new_tokens, sampling, record, return_logits
        )

    def start(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        seed: int = 0,
        record: bool = False,
        batch_multiple: int | None = None,
    ) -> Prefilled:
        """Prefill a batch and sample its first tokens. `batch_multiple`: pad the batch to a
        multiple of this (default: this placement's), for a cache that another engine decodes."""
        self.check_prompts(prompts)
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        longest = max(map(len, prompts))
        if longest + max_new_tokens > self.c.max_position_embeddings:
            raise UsageError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's context "
                f"of {self.c.max_position_embeddings}"
            )
        tokens, lens = self._padded(prompts, batch_multiple)
        max_len = self.config.engine.max_seq_len or bucket(
            max(tokens.shape[1], longest + max_new_tokens), MIN_POSITIONS
        )
        if longest >= max_len:
            raise UsageError(f"prompt of {longest} tokens does not fit the KV cache of {max_len} positions")
        pages = None
        if self.config.engine.page_size:
            cache, pages = self._paged_cache(tokens.shape[0], max_len)
        else:
            cache = self.new_cache(tokens.shape[0], max_len)
        dealer, prompt_lens = self.routing.start(self.c), [len(p) for p in prompts]
        t0 = compile_clock.now()
        logits, cache, picks = self._run_prefill(
            cache, tokens, lens, all_logits=False, record=record, dealer=dealer, prompt_lens=prompt_lens, pages=pages
        )
        seeds = seed_rows(seed, tokens.shape[0])
        tok = self._as_decoded(sample(logits, sampling, seeds, lens)).block_until_ready()
        t1 = compile_clock.now()
        return Prefilled(
            prompts,
            cache,
            tok,
            logits,
            lens,
            max_len,
            tokens.shape[1],
            seeds,
            dealer,
            picks,
            prefill_ms=compile_clock.run_ms(t0, t1),
            pages=pages,
        )

    def decode(
        self,
        state: Prefilled,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        record: bool = False,
        return_logits: bool = False,
    ) -> Generation:
        """Decode from `state` (this engine's prefill, or another's handed over) to max_new_tokens."""
        cache, tok, logits, picks, prompts, max_len = (
            state.cache,
            state.tok,
            state.logits,
            state.picks,
            state.prompts,
            state.max_len,
        )
        prompt_lens = [len(p) for p in prompts]
        t1 = compile_clock.now()
        lens = jnp.asarray(state.lens)
        out, step_logits = (
            [(tok, 1)],
            [logits] if return_logits else [],
        )  # (tokens [B] or [block, B], steps); logits when asked
        # Plain generation runs in blocks of steps; recording picks, keeping logits or a routing
        # override (picks fed per step from the host) go step by step.
        blocks = self.decode_block > 1 and not (record or return_logits or state.dealer is not None)
        if blocks:
            # Every block reads the positions the longest request reaches by the last step: one
            # program for the whole decode, not one more to compile or load as the rows grow.
            visible = decode_visible(int(np.max(state.lens)) + max_new_tokens - 1)
            if state.pages is not None or visible >= jax.tree.leaves(cache)[0].shape[-2]:
                visible = 0
            for step in range(1, max_new_tokens, self.decode_block):
                count = min(self.decode_block, max_new_tokens - step)
                toks, tok, cache = self._decode_block(
                    self.params,
                    cache,
                    tok,
                    lens,
                    state.seeds,
                    step,
                    count,
                    state.pages,
                    block=self.decode_block,
                    sampling=sampling,
                    visible=visible,
                )
                out.append((toks, count))
        else:
            for step in range(1, max_new_tokens):
                tok, logits, cache, p = self._decode(
                    self.params,
                    cache,
                    tok,
                    lens,
                    state.seeds,
                    step,
                    forced(state.dealer, "decode", valid_rows(prompt_lens, len(state.lens), 1, None)),
                    state.pages,
                    sampling=sampling,
                    record=record,
                )
                out.append((tok, 1))
                if return_logits:
                    step_logits.append(logits)
                picks.append(p)
        tok.block_until_ready()
        t2 = compile_clock.now()
        new = np.concatenate([np.atleast_2d(to_host(t))[:n] for t, n in out]).T  # [B, max_new_tokens]
        # A request ends when max_new_tokens are out or its cache is full (it may use every slot).
        budget = [min(max_new_tokens, max_len - len(p) + 1) for p in prompts]
        return Generation(
            tokens=[new[i, : budget[i]].tolist() for i in range(len(prompts))],
            finish_reasons=["length"] * len(prompts),
            picks=[[to_host(x) for x in p] for p in picks] if record else None,
            logits=np.stack([to_host(x)[: len(prompts)] for x in step_logits]) if return_logits else None,
            prefill_ms=state.prefill_ms,
            decode_step_ms=compile_clock.run_ms(t1, t2) / max(1, max_new_tokens - 1),
        )
