"""Continuous batching: a fixed number of decode slots over one KV cache [slots, max_len].

Each step decodes one token for every slot that is generating (one forward pass over all slots,
per-slot positions; idle slots write at position max_len, which the cache drops), then spends
what is left of the step's token budget on prefill chunks of admitted requests (vLLM's and
SGLang's chunked prefill: a long prompt never stalls the running requests for more than a chunk).
A request that stops (end-of-sequence, stop id or string, length, full cache) frees its slot at
once and the oldest waiting request takes it.

Every jitted program has a few fixed shapes: decode is [W, 1] over the first W slots (W a power
of two, or all slots), a prefill call is [prefill_rows, chunk] with the rows' cache slots gathered from and scattered back into the big cache, so after
`warm_up` no request compiles anything.

Why a contiguous cache row per slot and not paged blocks: XLA wants static shapes, and the
attention of `moejax.model` reads a contiguous [B, ..., S] cache; pages would need a block-table
gather in every attention layer of every placement (or a paged-attention kernel per backend) and
pay off only when memory, not compute, limits how many requests run at once. Here slots x max_len
is allocated up front and `--slots`/`--max-seq-len` size it; a page table is the next step when
long and short requests must share HBM.

Greedy tokens of a request do not depend on its neighbours: every row's attention sees only its
own slot, and the MoE placements compute each row's experts independently.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Callable

import jax
import numpy as np

from moejax.engine.engine import MIN_POSITIONS, bucket, forced, to_host
from moejax.errors import UsageError
from moejax.serving.request import Request, check_request, sampling_rows
from moejax.serving.slot_programs import decode_slots, fork_slots, prefill_slots, put_positions, take_positions


class QueueFull(Exception):
    """The waiting queue holds --max-queue requests already."""


class Draining(Exception):
    """The scheduler is shutting down and admits nothing new."""


@dataclasses.dataclass
class _Slot:
    request: Request
    done: int = 0  # prompt positions prefilled
    pos: int = 0  # decode: the position of `token`, fed in the next step
    token: int = 0
    draft: int = 0  # MTP: the draft for pos + 1 (speculative.py)
    leader: int | None = None  # n > 1: the slot prefilling this sample's prompt, forked from when done


# ----------------------------------------------------------------------------- the scheduler

SERVE_PREFILL_CHUNK = 64


class Scheduler:
    """Owns the KV cache and the slots; `step` is called from one engine thread, `submit` from any."""

    def __init__(self, engine, slots: int = 16, max_len: int = 0, prefill_rows: int = 1, token_budget: int = 0,
                 max_queue: int = 1024, prefill_engine=None, longest: int = 0):
        """`prefill_engine`: prefill chunks run there instead (another placement and mesh, a
        cache of every slot of its own), and the positions each call wrote go over to `engine`'s
        cache right after it (prefill and decode apart, `engine/disaggregated.py`).
        `max_len` 0: a cache of `longest` positions (prompt + new tokens of the longest request
        it will hold, when known), else of the model's context, at most 2048. Every decode step
        reads each slot's whole cache, so its length is paid on every token: 16 requests of
        32 + 64 tokens on the benchmark model decode at 178 ms/token in a 2048-position cache
        against 75 ms in a 128-position one."""
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
            raise UsageError(f"--slots {slots} must be a positive multiple of {multiple} (requests are split over the devices)")
        prefill_multiple = self.prefill_engine.placement.batch_multiple()
        if (prefill_rows * self.chunk) % prefill_multiple:
            raise UsageError(f"a prefill call of {prefill_rows} x {self.chunk} rows must split over {prefill_multiple} "
                             f"devices; choose --prefill-chunk a multiple of {prefill_multiple}")
        if self.max_len > c.max_position_embeddings:
            raise UsageError(f"--max-seq-len {self.max_len} exceeds the model's context of {c.max_position_embeddings}")
        self.num_slots, self.prefill_rows = slots, prefill_rows
        # Tokens per step: by default every slot's decode token plus one prefill call.
        self.token_budget = token_budget or slots + prefill_rows * self.chunk
        self.max_queue = max_queue
        self.slots: list[_Slot | None] = [None] * slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: collections.deque[int] = collections.deque()  # slots in admission order
        self.cache = engine.new_cache(slots, self.max_len)
        self.prefill_cache = self.prefill_engine.new_cache(slots, self.max_len) if self.apart else None
        self.handover_bytes = 0  # prefill apart: cache bytes that changed device
        self.pick_observers: list[Callable[[str, np.ndarray, np.ndarray], None]] = []  # (kind, ids [L,R,k], valid [R])
        self.between_steps: list[Callable[[], None]] = []  # run on the engine thread before each step (expert moves)
        self.rebalancer = None  # online expert placement (`serving/online_eplb.py`), when one runs
        self.dealer = engine.routing.start(c)  # a routing override's picks, call by call (None: the router's)
        self._cv = threading.Condition()
        self._draining = False
        bind = dict(c=c, placement=engine.placement)
        self._decode = jax.jit(functools.partial(decode_slots, **bind), donate_argnums=1,
                               static_argnames=("greedy_only", "extras"))
        self._prefill = jax.jit(functools.partial(prefill_slots, c=c, placement=self.prefill_engine.placement),
                                donate_argnums=1, static_argnames=("greedy_only", "extras", "prompt_logprobs"))
        self._fork_program = jax.jit(fork_slots, donate_argnums=0)
        self.prefilled_tokens = 0  # prompt positions prefilled (n samples of a prompt: once)
        if self.apart:
            seq_axes = [{k: a.index("cache_seq") for k, a in axes.items()} for axes in engine.placement.cache_axes(self.cache)]
            self._take = jax.jit(functools.partial(take_positions, seq_axes=seq_axes))
            self._put = jax.jit(functools.partial(put_positions, seq_axes=seq_axes), donate_argnums=0)

    # ------------------------------------------------------------------ requests in
    def check(self, request: Request) -> None:
        """Raises UsageError for a request that can never run (the HTTP side answers 400)."""
        check_request(request, self.engine.c.vocab_size, self.max_len, self.num_slots)

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
        decoding = [s for s, slot in enumerate(self.slots)
                    if slot is not None and s not in self.prefilling and slot.leader is None]
        if decoding:
            self._decode_step(decoding)
        chunks = max(1, (self.token_budget - len(decoding)) // self.chunk)
        while self.prefilling and chunks > 0:
            rows = list(self.prefilling)[: min(chunks, self.prefill_rows)]
            self._prefill_call(rows)
            chunks -= len(rows)

    def _admit(self) -> None:
        with self._cv:
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
            for s, slot in enumerate(self.slots):
                if slot is not None and slot.request.cancelled:
                    self.slots[s] = None
                    if s in self.prefilling:
                        self.prefilling.remove(s)
                    for f in [f for f, other in enumerate(self.slots) if other is not None and other.leader == s]:
                        self.slots[f] = None
            free = [s for s in range(self.num_slots) if self.slots[s] is None]
            # First come, first served: a request of n samples waits for n free slots.
            while self.waiting and len(free) > len(self.waiting[0].samples):
                r = self.waiting.popleft()
                s = free.pop(0)
                self.slots[s] = _Slot(r)
                self.prefilling.append(s)
                for sample in r.samples:
                    self.slots[free.pop(0)] = _Slot(sample, leader=s)

    def decode_widths(self) -> list[int]:
        """The decode batch sizes: powers of two from the devices' multiple, and all slots. Slots are
        taken lowest first, so few requests decode in a narrow batch (a step over all slots costs
        about 3x a one-row step on the bench model). At least 2: XLA:CPU turns a one-row gather
        into a slice and then copies the whole cache every step."""
        multiple = max(2, self.engine.placement.batch_multiple())
        widths = {self.num_slots}
        while multiple < self.num_slots:
            widths.add(multiple)
            multiple *= 2
        return sorted(widths)

    def _decode_step(self, decoding: list[int]) -> None:
        width = min(w for w in self.decode_widths() if w > max(decoding))
        tokens = np.zeros(width, np.int32)
        positions = np.full(width, self.max_len, np.int32)  # idle: writes dropped
        for s in decoding:
            tokens[s], positions[s] = self.slots[s].token, self.slots[s].pos
        sampling, flags = sampling_rows([self.slots[s].request if s in decoding else None for s in range(width)], width)
        out, lp, self.cache, picks = self._decode(self.engine.params, self.cache, np.arange(width, dtype=np.int32),
                                                  tokens, positions, sampling,
                                                  forced=forced(self.dealer, "decode", positions < self.max_len), **flags)
        out, lp = to_host(out), {k: to_host(v) for k, v in lp.items()}
        self._observe("decode", picks, positions < self.max_len)
        now = time.perf_counter()
        for s in decoding:
            slot = self.slots[s]
            slot.pos += 1
            slot.request.record(lp, s)
            self._emit(s, int(out[s]), now)

    def _prefill_call(self, rows: list[int]) -> None:
        p, c = self.prefill_rows, self.chunk
        slots = np.full(p, self.num_slots, np.int32)  # padding rows: out of range
        tokens = np.zeros((p, c), np.int32)
        start, last, after = np.zeros(p, np.int32), np.zeros(p, np.int32), np.zeros(p, np.int32)
        valid = np.zeros((p, c), bool)
        requests = [self.slots[s].request for s in rows]
        for i, (s, r) in enumerate(zip(rows, requests)):
            done = self.slots[s].done
            piece = r.prompt[done : done + c]
            slots[i], start[i], last[i] = s, done, len(r.prompt) - 1
            after[i] = r.prompt[done + c] if done + c < len(r.prompt) else 0
            tokens[i, : len(piece)] = piece
            valid[i, : len(piece)] = True
        sampling, flags = sampling_rows(requests, p)
        echo = any(r.echo_logprobs for r in requests)  # every position's logits: only in calls that need them
        out, lp, logits, self.prefill_into, picks = self._prefill(
            self.prefill_engine.params, self.prefill_into, slots, tokens, start, last, after, sampling,
            forced=forced(self.dealer, "prefill", valid.reshape(-1)), prompt_logprobs=echo, **flags)
        out, lp = to_host(out), jax.tree.map(to_host, lp)
        self.prefilled_tokens += int(valid.sum())
        self._observe("prefill", picks, valid.reshape(-1))
        if self.apart:
            self.handover_bytes += self._hand_over(slots, start)
        for i, r in enumerate(requests):
            if r.echo_logprobs:  # position t's entry is the logprob of prompt token t + 1
                r.record(lp["prompt"], i, prompt=True, at=slice(0, min(c, last[i] - start[i])))
        finished = self._advance_prefill(rows, c)
        now = time.perf_counter()
        for i, s in finished:
            r = self.slots[s].request
            self.slots[s].pos = self.slots[s].done
            if r.samples:
                self._fork_samples(s, to_host(logits)[i], now)
            if r.max_tokens == 0:
                self._emit(s, None, now)
            else:
                r.record(lp, i)
                self._emit(s, int(out[i]), now)

    def _fork_samples(self, source: int, logits: np.ndarray, now: float) -> None:
        """The other samples of slot `source`'s prompt, now prefilled: its cache row copied into
        theirs, each one's first token drawn from its last logits [V] (through the host: with
        prefill apart they are on the other mesh) with its own seed."""
        forks = [s for s, slot in enumerate(self.slots) if slot is not None and slot.leader == source]
        slots = np.full(self.num_slots, self.num_slots, np.int32)  # padding: out of range
        slots[: len(forks)] = forks
        requests = [self.slots[s].request for s in forks]
        sampling, _ = sampling_rows(requests, self.num_slots, extras=True)
        positions = np.full(self.num_slots, len(requests[0].prompt), np.int32)
        out, lp, self.cache = self._fork_program(self.cache, np.int32(source), slots, logits, sampling, positions)
        out, lp = to_host(out), {k: to_host(v) for k, v in lp.items()}
        leader = self.slots[source].request
        for i, s in enumerate(forks):
            slot, r = self.slots[s], requests[i]
            slot.leader, slot.done = None, len(r.prompt)
            slot.pos = slot.done
            r.prompt_logprobs = leader.prompt_logprobs
            if r.max_tokens == 0:
                self._emit(s, None, now)
            else:
                r.record(lp, i)
                self._emit(s, int(out[i]), now)

    @property
    def prefill_into(self) -> list[dict]:
        """The cache prefill chunks write: the decode cache, or with prefill apart its own."""
        return self.prefill_cache if self.apart else self.cache

    @prefill_into.setter
    def prefill_into(self, cache: list[dict]) -> None:
        if self.apart:
            self.prefill_cache = cache
        else:
            self.cache = cache

    def _hand_over(self, slots: np.ndarray, start: np.ndarray) -> int:
        """Prefill apart: the cache positions a prefill call just wrote (chunk positions from
        `start` [P] of `slots` [P]; padding rows name slot S: zeros read, writes dropped) from the
        prefill cache into the decode cache, streamed call by call (a fixed shape: nothing
        compiles per prompt length) -> bytes that changed device."""
        from moejax.engine.disaggregated import move_cache

        positions = start[:, None] + np.arange(self.chunk, dtype=np.int32)  # [P, C]; past max_len: dropped
        pieces, moved = move_cache(self._take(self.prefill_cache, slots, positions), self.engine.placement,
                                   list(self.prefill_engine.placement.mesh.devices.flat))
        self.cache = self._put(self.cache, slots, positions, pieces)
        return moved

    def _advance_prefill(self, rows: list[int], c: int) -> list[tuple[int, int]]:
        """After a prefill call of `c` positions for the slots `rows`: (row, slot) of those whose
        prompt is now whole; the others' next chunks wait behind the rest's (round robin)."""
        finished = []
        for i, s in enumerate(rows):
            slot = self.slots[s]
            slot.done = min(slot.done + c, len(slot.request.prompt))
            self.prefilling.remove(s)
            if slot.done == len(slot.request.prompt):
                finished.append((i, s))
            else:
                self.prefilling.append(s)
        return finished

    def _emit(self, s: int, token: int | None, now: float) -> None:
        """Slot s's new token (None: max_tokens 0, the request ends without one)."""
        slot = self.slots[s]
        r = slot.request
        delta = ""
        if token is not None:
            slot.token = token
            r.token_times.append(now)
            delta = r.stopper.add(token)
        # The cache holds positions 0..max_len-1: a token at max_len could never be fed back.
        if r.finish_reason is None and (len(r.tokens) >= r.max_tokens or slot.pos >= self.max_len):
            delta += r.stopper.finish_length()
        done = r.finish_reason is not None
        if done:
            r.finished = now
            with self._cv:
                self.slots[s] = None
        if r.on_event is not None:
            r.on_event(token, delta, done)

    def _observe(self, kind: str, picks: list, valid: np.ndarray) -> None:
        if self.pick_observers and picks:
            ids = np.stack([to_host(p) for p in picks])  # [L, R, k]
            for observe in self.pick_observers:
                observe(kind, ids, valid)

    # ------------------------------------------------------------------ warm-up
    def warm_up(self) -> None:
        """Compiles every program a request can use (greedy, sampled, with logprobs / bias, with
        prompt logprobs, the fork of n samples) on idle rows, which write nothing."""
        p, n = self.prefill_rows, self.num_slots
        for greedy, extras in ((True, False), (False, False), (False, True)):
            for w in self.decode_widths():
                sampling, _ = sampling_rows([], w, extras=extras)
                _, _, self.cache, _ = self._decode(self.engine.params, self.cache, np.arange(w, dtype=np.int32),
                                                   np.zeros(w, np.int32), np.full(w, self.max_len, np.int32), sampling,
                                                   forced=forced(self.dealer, "decode", np.zeros(w, bool)),
                                                   greedy_only=greedy, extras=extras)
            for echo in (False, True) if extras else (False,):
                sampling, _ = sampling_rows([], p, extras=extras)
                zeros = np.zeros(p, np.int32)
                out, _, logits, self.prefill_into, _ = self._prefill(
                    self.prefill_engine.params, self.prefill_into, np.full(p, n, np.int32),
                    np.zeros((p, self.chunk), np.int32), zeros, zeros, zeros, sampling,
                    forced=forced(self.dealer, "prefill", np.zeros(p * self.chunk, bool)),
                    greedy_only=greedy, extras=extras, prompt_logprobs=echo)
                out.block_until_ready()
        sampling, _ = sampling_rows([], n, extras=True)
        out, _, self.cache = self._fork_program(self.cache, np.int32(0), np.full(n, n, np.int32), to_host(logits)[0],
                                                sampling, np.zeros(n, np.int32))
        out.block_until_ready()
        if self.apart:  # compiles the positions' move (padding rows only: nothing written)
            self._hand_over(np.full(p, n, np.int32), np.zeros(p, np.int32))
