"""Continuous batching over a paged KV cache: up to `slots` requests decode together, each
holding the pages of the positions it has written (vLLM's PagedAttention and its scheduler).

Each step decodes one token for every slot that is generating (one forward pass, per-row
positions and block tables), then spends what is left of the step's token budget on prefill
chunks of admitted requests (vLLM's and SGLang's chunked prefill: a long prompt never stalls the
running requests for more than a chunk). A request is admitted while a slot is free and the pool
has the pages of its prompt (less those the prefix cache holds already, `prefix_cache.py`) and of
its first new token; decoding takes a page as a request crosses into one, and when none is free
the newest running request gives its pages back and waits to be computed again (prompt and
tokens so far, in prefill chunks: preemption by recompute), so no request is lost and none reads
another's pages. A request that stops (end-of-sequence, stop id or string, length) frees its slot
and pages at once. n samples of a prompt share its full pages; each copies its last, partly
written one.

The host-side policy (`_admit`, `_advance_prefill`, `_emit`: what runs this step and what follows
from its tokens; the pages each slot holds, `slot_pages.py`) is apart from the calls of the jitted
programs (`_decode_step`, `_prefill_call`, `_fork_samples`, `_hand_over`, `program_calls.py`),
which only turn it into arrays.

Every jitted program has a few fixed shapes: decode is [W, 1] over the first W slots (W a power
of two, or all slots), a prefill call [prefill_rows, chunk]; block tables are inputs [rows, P]
with P one of a few widths holding the longest row's pages (`KVPages.widths`), so a step reads
the pages its requests hold, not `max_len` positions per slot, and after `warm_up` no request
compiles anything.

Under DP attention each rank is a pool of its own (`KVPages`): slot s runs on rank s % ranks, in
its rank's block of every batch's rows (`row`), and holds only that rank's pages; admission,
preemption and n samples stay within a rank.

A model with sliding-window layers keeps their pages apart (`window_kv`, vLLM's hybrid KV-cache
manager; `slot_pages.py`). The prefix cache is off for such a model: a cached prefix would need
the window pages of its last positions kept too.

Greedy tokens of a request do not depend on its neighbours: every row's attention sees only its
own pages, and the MoE placements compute each row's experts independently.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from moejax.base.errors import UsageError
from moejax.engine.engine import MIN_POSITIONS, bucket
from moejax.engine.pages import pages_for
from moejax.serving.kv_pages import PAGE_SIZE, KVPages, pool_pages, window_held, window_pool_pages
from moejax.serving.program_calls import ProgramCalls
from moejax.serving.request import Request, check_request
from moejax.serving.slot_pages import SlotPages


class QueueFull(Exception):
    """The waiting queue holds --max-queue requests already."""


class Draining(Exception):
    """The scheduler is shutting down and admits nothing new."""


@dataclasses.dataclass
class _Slot:
    request: Request
    # What prefill computes: the prompt, or after a preemption the prompt and every token out but
    # the last (which decoding then feeds).
    seq: list[int]
    admitted: int  # admission order: the newest running request is preempted first
    pages: list[int] = dataclasses.field(default_factory=list)  # its block table: pages in order
    window: list[int] = dataclasses.field(default_factory=list)  # sliding-window layers' table (none: freed)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # prefix cache: its full pages' keys
    done: int = 0  # seq positions prefilled (or found in the prefix cache)
    pos: int = 0  # decode: the position of `token`, fed in the next step
    token: int = 0
    draft: int = 0  # MTP: the draft for pos + 1 (speculative.py)
    leader: int | None = None  # n > 1: the slot prefilling this sample's prompt, forked from when done


# ----------------------------------------------------------------------------- the scheduler

SERVE_PREFILL_CHUNK = 64


class Scheduler(SlotPages, ProgramCalls):
    """Owns the KV cache's page pool and the slots; `step` is called from one engine thread,
    `submit` from any."""

    writes_per_step = 1  # positions a decode step writes per request, from its `pos`
    mtp_pool = False  # whether the MTP layer has a page pool of the same pages (`speculative.py`)

    def __init__(
        self,
        engine,
        slots: int = 16,
        max_len: int = 0,
        prefill_rows: int = 1,
        token_budget: int = 0,
        max_queue: int = 1024,
        prefill_engine=None,
        longest: int = 0,
        kv_tokens: int = 0,
        kv_gb: float = 0.0,
        page_size: int = PAGE_SIZE,
        prefix_cache: bool = True,
        window_pages: int = 0,
    ):
        """`prefill_engine`: prefill chunks run there instead (another placement and mesh, a
        pool of its own with the same page ids), and the pages each call wrote go over to
        `engine`'s pool right after it (prefill and decode apart, `engine/disaggregated.py`).
        `slots`: requests decoding together at most; `max_len`: the longest request (prompt and
        new tokens) allowed, 0: `longest` (that of the requests it will hold, when known), else
        the model's context, at most 2048; `kv_tokens` / `kv_gb`: the page pool's positions or
        GB (neither: the platform's default, `kv_pages.pool_pages`); `page_size`: positions per
        page; `window_pages`: the sliding-window layers' pool (0: `kv_pages.window_pool_pages`);
        `prefix_cache`: a request reuses the pages of the longest prompt prefix computed
        before (off under a routing override, whose picks are dealt per computed position, and
        for requests that want every prompt position's logprobs; `notes` says so)."""
        self.engine = engine
        self.prefill_engine = prefill_engine or engine
        self.apart = self.prefill_engine is not engine
        c = engine.c
        # Unset, a prefill call takes 64 positions per request: a call runs between two decode
        # steps, so its length is every running request's inter-token latency (the static engine's
        # one-call-per-prompt default would stall them for a whole prompt).
        self.chunk = engine.config.engine.prefill_chunk or SERVE_PREFILL_CHUNK
        self.max_len = max_len or min(c.max_position_embeddings, bucket(longest, MIN_POSITIONS) if longest else 2048)
        multiple = engine.placement.batch_multiple()
        if slots < 1 or slots % multiple:
            raise UsageError(
                f"--slots {slots} must be a positive multiple of {multiple} (requests are split over the devices)"
            )
        prefill_multiple = self.prefill_engine.placement.batch_multiple()
        if (prefill_rows * self.chunk) % prefill_multiple:
            raise UsageError(
                f"a prefill call of {prefill_rows} x {self.chunk} rows must split over {prefill_multiple} "
                f"devices; choose --prefill-chunk a multiple of {prefill_multiple}"
            )
        if self.max_len > c.max_position_embeddings:
            raise UsageError(f"--max-seq-len {self.max_len} exceeds the model's context of {c.max_position_embeddings}")
        self.num_slots, self.prefill_rows = slots, prefill_rows
        self.dealer = engine.routing.start(c)  # a routing override's picks, call by call (None: the router's)
        self.notes: list[str] = []  # one line each: what the server runs otherwise than asked
        if prefix_cache and self.dealer is not None:
            self.notes.append(
                "the prefix cache is off under a routing override (its picks follow the computed positions)"
            )
        # DP attention: slot s runs on rank s % ranks, each rank from its own pages (`KVPages`).
        self.ranks = multiple
        if self.apart and prefill_multiple > 1 and prefill_multiple != multiple:
            raise UsageError(
                f"prefill and decode apart split requests over {prefill_multiple} and {multiple} DP ranks: "
                "each rank's pages must be the same on both meshes; use as many DP ranks for both, or "
                "TP attention for prefill"
            )
        # A prefill call's rows split over the ranks only when they divide (else every device runs every row).
        self.prefill_ranks = prefill_multiple if self.prefill_rows % prefill_multiple == 0 else 1
        if prefix_cache and c.sliding_layers:
            self.notes.append(
                "the prefix cache is off for sliding-window layers (their cached prefix's window pages are freed)"
            )
            prefix_cache = False
        window_pages = window_pages or window_pool_pages(c, page_size, self.chunk, self.max_len, slots)
        pages = pool_pages(engine, page_size, kv_tokens, kv_gb, multiple, mtp=self.mtp_pool, window_pages=window_pages)
        self.kv = KVPages(pages, page_size, self.max_len, prefix_cache and self.dealer is None, self.ranks)
        # The sliding-window layers' pages (None: a model without them), per rank as the full ones.
        self.window_kv = KVPages(window_pages, page_size, self.max_len, False, self.ranks) if c.sliding_layers else None
        held = window_held(c, page_size, self.chunk, self.max_len)
        if self.window_kv is not None and self.window_kv.rank_pages < held:
            raise UsageError(
                f"a rank's {self.window_kv.rank_pages} sliding-window pages hold less than one "
                f"request's window and prefill chunk ({held} pages)"
            )
        # Tokens per step: by default every slot's decode token plus one prefill call.
        self.token_budget = token_budget or slots + prefill_rows * self.chunk
        self.max_queue = max_queue
        self.slots: list[_Slot | None] = [None] * slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: collections.deque[int] = collections.deque()  # slots in admission order
        self.admitted = 0  # requests admitted so far (a slot's admission order)
        self.preemptions = 0  # running requests whose pages went to older ones (recomputed later)
        self.prefilled_tokens = 0  # positions prefilled (a prefix-cache hit's and n samples' once: not again)
        self.mixed_steps = 0  # steps that decoded and prefilled (continuous batching at work)
        self.cache = engine.new_pool(pages, page_size, window_pages)
        self.prefill_cache = self.prefill_engine.new_pool(pages, page_size, window_pages) if self.apart else None
        self.handover_bytes = 0  # prefill apart: cache bytes that changed device
        self.pick_observers: list[Callable[[str, np.ndarray, np.ndarray], None]] = []  # (kind, ids [L,R,k], valid [R])
        self.between_steps: list[Callable[[], None]] = []  # run on the engine thread before each step (expert moves)
        self.rebalancer = None  # online expert placement (`serving/online_eplb.py`), when one runs
        self._cv = threading.Condition()
        self._draining = False
        self._jit_programs()

    # ------------------------------------------------------------------ requests in
    def check(self, request: Request) -> None:
        """Raises UsageError for a request that can never run (the HTTP side answers 400)."""
        check_request(request, self.engine.c.vocab_size, self.max_len, self.num_slots)
        if 1 + len(request.samples) > self.num_slots // self.ranks:
            raise UsageError(
                f"n={1 + len(request.samples)} samples share their prompt's pages on one of {self.ranks} "
                f"DP ranks, which has {self.num_slots // self.ranks} slots"
            )
        self.kv.check(len(request.prompt))

    def submit(self, request: Request) -> None:
        self.check(request)
        with self._cv:
            if self._draining:
                raise Draining()
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
            self.waiting.append(request)
            self._cv.notify()

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """The engine thread: steps while there is work; after `drain`, returns once all is done."""
        while True:
            with self._cv:
                while not self.waiting and not self.running:
                    if self._draining:
                        return
                    self._cv.wait()
            self.step()

    def drain(self) -> None:
        """Stop admitting new requests; `run` returns when every accepted one has finished."""
        with self._cv:
            self._draining = True
            self._cv.notify()

    def fail(self, message: str) -> None:
        """Every request held fails with `message` (the HTTP side answers 503); none is admitted after."""
        with self._cv:
            self._draining = True
            held = list(self.waiting) + [slot.request for slot in self.slots if slot is not None]
            self.waiting.clear()
        for r in held:
            r.error = message
            if r.on_event is not None:
                r.on_event(None, "", True)

    def run_all(self, requests: list[Request]) -> list[Request]:
        """Offline use: every request through the scheduler on this thread."""
        for r in requests:
            self.check(r)
        with self._cv:
            self.waiting.extend(requests)
        while self.waiting or self.running:
            self.step()
        return requests

    def step(self) -> None:
        for hook in self.between_steps:
            hook()
        self._admit()
        decoding = self._grow(
            [
                s
                for s, slot in enumerate(self.slots)
                if slot is not None and s not in self.prefilling and slot.leader is None
            ]
        )
        if decoding:
            self._decode_step(decoding)
        chunks = max(1, (self.token_budget - len(decoding)) // self.chunk)
        self.mixed_steps += bool(decoding and self.prefilling)
        while self.prefilling and chunks > 0:
            rows = self._prefill_rows(chunks)
            chunks -= sum(s is not None for s in rows)
            rows = self._window_for_prefill(rows)
            if any(s is not None for s in rows):
                self._prefill_call(rows)

    # ------------------------------------------------------------------ host-side policy
    def rank(self, s: int) -> int:
        """The DP rank slot s runs on (its pages are that rank's)."""
        return s % self.ranks

    def row(self, s: int, width: int) -> int:
        """Slot s's row in a batch of `width` rows (a multiple of the ranks): each rank runs a block
        of width / ranks rows, and slots taken lowest first fill every rank's first rows."""
        return self.rank(s) * (width // self.ranks) + s // self.ranks

    def _prefill_rows(self, most: int) -> list[int | None]:
        """A prefill call's slots by row (None: a padding row): the oldest prefilling ones, at most
        `most`; with rows split over the ranks, each in a row of its own rank's block."""
        p, ranks = self.prefill_rows, self.prefill_ranks
        rows: list[int | None] = [None] * p
        used = [0] * ranks
        for s in list(self.prefilling)[: p if ranks == 1 else len(self.prefilling)]:
            rank = self.rank(s) if ranks > 1 else 0
            if most > 0 and used[rank] < p // ranks:
                rows[rank * (p // ranks) + used[rank]] = s
                used[rank] += 1
                most -= 1
        return rows

    def _admit(self) -> None:
        """Cancelled requests out; then the oldest waiting requests into free slots while the pool
        has the pages of what they prefill, their first new token and a page per forked sample."""
        with self._cv:
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
            for s, slot in enumerate(self.slots):
                if slot is not None and slot.request.cancelled:
                    self._free(s)
            free = [[] for _ in range(self.ranks)]  # each rank's free slots, lowest first
            for s in range(self.num_slots):
                if self.slots[s] is None:
                    free[self.rank(s)].append(s)
            while self.waiting:
                r = self.waiting[0]
                samples = [] if r.tokens else r.samples  # tokens out: preempted, its samples forked already
                seq = r.prompt + r.tokens[:-1]
                # Ranks with a slot for the request and one for each sample (forks share its pages' rank).
                ranks = sorted(
                    (rank for rank in range(self.ranks) if len(free[rank]) > len(samples)),
                    key=lambda rank: free[rank][0],
                )
                # Window pages: its first chunk's and one per sample (later chunks take theirs as they go).
                window_need = pages_for(min(len(seq), self.chunk), self.kv.page_size) + len(samples)
                if self.window_kv is not None:
                    ranks = [rank for rank in ranks if self.window_kv.available(rank) >= window_need]
                got = self.kv.admit(seq, len(samples), cached=not r.echo_logprobs, ranks=ranks) if ranks else None
                if got is None:
                    break
                self.waiting.popleft()
                rank, pages, keys, done, fork_pages = got
                window = self.window_kv.take(window_need, rank) if self.window_kv is not None else []
                own = window_need - len(samples)
                fork_windows = [[page] for page in window[own:]] if window else [[] for _ in samples]
                s = free[rank].pop(0)
                self.slots[s] = _Slot(r, seq, self.admitted, pages, window[:own], keys, done)
                self.prefilling.append(s)
                for sample, page, fork_window in zip(samples, fork_pages, fork_windows):
                    self.slots[free[rank].pop(0)] = _Slot(
                        sample, sample.prompt, self.admitted, [page], fork_window, leader=s
                    )
                self.admitted += 1

    def _advance_prefill(self, rows: list[int | None], c: int) -> list[tuple[int, int]]:
        """After a prefill call of `c` positions for the slots `rows` (None: padding): (row, slot)
        of those whose seq is now whole; the others' next chunks wait behind the rest's (round robin)."""
        finished = []
        for i, s in enumerate(rows):
            if s is None:
                continue
            slot = self.slots[s]
            self.prefilled_tokens += min(c, len(slot.seq) - slot.done)
            slot.done = min(slot.done + c, len(slot.seq))
            self.kv.written(slot.pages, slot.keys, slot.done)
            self.prefilling.remove(s)
            if slot.done == len(slot.seq):
                finished.append((i, s))
            else:
                self.prefilling.append(s)
        return finished

    def _start_decoding(self, s: int, token: int | None, now: float) -> None:
        """Slot s's seq is prefilled and `token` follows it: out as its first new token, or after
        a preemption (its tokens out already, the last not prefilled) fed back as they were."""
        slot = self.slots[s]
        slot.pos = slot.done
        if slot.request.tokens:
            slot.token = slot.request.tokens[-1]
        else:
            self._emit(s, token, now)

    def _emit(self, s: int, token: int | None, now: float) -> None:
        """Slot s's new token (None: max_tokens 0, the request ends without one)."""
        slot = self.slots[s]
        r = slot.request
        delta = ""
        if token is not None:
            slot.token = token
            r.token_times.append(now)
            delta = r.stopper.add(token)
        # A token at `limit` could never be fed back: past the context allowed, or the whole pool.
        if r.finish_reason is None and (len(r.tokens) >= r.max_tokens or slot.pos >= self.kv.limit):
            delta += r.stopper.finish_length()
        done = r.finish_reason is not None
        if done:
            r.finished = now
            with self._cv:
                self._free(s)
        if r.on_event is not None:
            r.on_event(token, delta, done)
