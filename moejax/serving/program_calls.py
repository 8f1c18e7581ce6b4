"""The scheduler's calls of its jitted programs (`slot_programs.py`): each turns what the
host-side policy of `scheduler.py` chose for this step (which slots decode, which prefill, which
fork) into the programs' arrays (tokens, positions, block tables, sampling rows), runs the
program, and hands its tokens back to the policy (`_emit`, `_advance_prefill`,
`_start_decoding`). Also the prefill hand-over of pages between two meshes and the warm-up that
compiles every program a request can use.

Every program call goes through a step plan `Call` (`step_plan.py`): its host inputs as named
arrays and its static flags, run by `_run` -> `_do_<name>`. Over several processes, process 0
sends each call to the followers before running it (`link`, `plan_link.py`), and a follower
(`follower.py`) runs it through the same `_do_` method on its own shards. Results are read back
on every process: a batch-sharded output spans the processes, and its gather is a collective
each of them joins (followers drop what they read).
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from moejax.engine.host import to_host
from moejax.engine.programs import jit_program
from moejax.model import paged
from moejax.serving.request import sampling_rows
from moejax.serving.slot_programs import decode_slots, fork_slots, prefill_slots, put_pages, take_pages
from moejax.serving.step_plan import Call, flat, nested


class ProgramCalls:
    """The program half of `scheduler.Scheduler` (its state: engine(s), cache(s), kv, slots)."""

    link = None  # process 0 of several: where each call goes before it runs (`plan_link.Leader`)

    def _jit_programs(self) -> None:
        c = self.engine.c
        self._decode = jit_program(
            functools.partial(decode_slots, c=c, placement=self.engine.placement),
            self.engine.dtype,
            self.engine.placement.platform,
            decode=True,
            donate_argnums=1,
            static_argnames=("greedy_only", "extras"),
        )
        self._prefill = jit_program(
            functools.partial(prefill_slots, c=c, placement=self.prefill_engine.placement),
            self.prefill_engine.dtype,
            self.prefill_engine.placement.platform,
            donate_argnums=1,
            static_argnames=("greedy_only", "extras", "prompt_logprobs"),
        )
        self._fork_program = jax.jit(functools.partial(fork_slots, placement=self.engine.placement), donate_argnums=0)
        if self.apart:
            self._take = jax.jit(take_pages)
            self._put = jax.jit(put_pages, donate_argnums=0)

    def decode_widths(self) -> list[int]:
        """The decode batch sizes: powers of two from the devices' multiple, and all slots. Slots are
        taken lowest first, so few requests decode in a narrow batch. At least 2: XLA:CPU turns a
        one-row gather into a slice and then copies the whole array it reads from."""
        multiple = max(2, self.engine.placement.batch_multiple())
        widths = {self.num_slots}
        while multiple < self.num_slots:
            widths.add(multiple)
            multiple *= 2
        return sorted(widths)

    def _decode_rows(self, decoding: list[int]) -> tuple[int, dict[int, int]]:
        """(the decode batch's width, each decoding slot's row in it: in its rank's block)."""
        width = min(w for w in self.decode_widths() if w > max(decoding))
        return width, {s: self.row(s, width) for s in decoding}

    def _decode_step(self, decoding: list[int]) -> None:
        width, row = self._decode_rows(decoding)
        at = {i: s for s, i in row.items()}  # row -> slot
        tokens = np.zeros(width, np.int32)
        positions = np.full(width, self.max_len, np.int32)  # idle: no pages, writes dropped
        for s in decoding:
            tokens[row[s]], positions[row[s]] = self.slots[s].token, self.slots[s].pos
        reach = max(self.slots[s].pos + 1 for s in decoding)
        pages = self.kv.table([self.slots[at[i]].pages if i in at else [] for i in range(width)], width, reach)
        sampling, flags = sampling_rows([self.slots[at[i]].request if i in at else None for i in range(width)], width)
        live = positions < self.max_len
        arrays = dict(
            pages=pages,
            **self._window_table([at.get(i) for i in range(width)], reach),
            tokens=tokens,
            positions=positions,
            **flat("sampling", sampling),
            **self._forced("decode", live),
        )
        out, lp, picks = self._run(Call("decode", arrays, dict(flags, observe=bool(self.pick_observers))))
        self._observe("decode", picks, live)
        now = time.perf_counter()
        for s in decoding:
            slot = self.slots[s]
            slot.pos += 1
            slot.request.record(lp, row[s])
            self._emit(s, int(out[row[s]]), now)

    def _prefill_inputs(self, rows: list[int | None], reach: int = 0):
        """A prefill call's (block tables [P, W], tokens [P, C], start [P], last [P], after [P],
        valid [P, C]) for the slots `rows` (None: a padding row, no pages, nothing valid); the
        tables hold `reach` positions past the chunk too (the MTP writes one)."""
        p, c = self.prefill_rows, self.chunk
        tokens, valid = np.zeros((p, c), np.int32), np.zeros((p, c), bool)
        start, last, after = np.zeros(p, np.int32), np.zeros(p, np.int32), np.zeros(p, np.int32)
        for i, s in enumerate(rows):
            if s is None:
                continue
            slot = self.slots[s]
            piece = slot.seq[slot.done : slot.done + c]
            start[i], last[i] = slot.done, len(slot.seq) - 1
            after[i] = slot.seq[slot.done + c] if slot.done + c < len(slot.seq) else 0
            tokens[i, : len(piece)] = piece
            valid[i, : len(piece)] = True
        pages = self.kv.table(
            [self.slots[s].pages if s is not None else [] for s in rows], p, int(start.max()) + c + reach
        )
        return pages, tokens, start, last, after, valid

    def _window_table(self, rows: list[int | None], positions: int) -> dict:
        """{"window_pages": the sliding-window layers' block tables [len(rows), W] of slots `rows`
        (None: no page), W as the full tables' for `positions`}, or {} for a model without them."""
        if self.window_kv is None:
            return {}
        return {
            "window_pages": self.window_kv.table(
                [self.slots[s].window if s is not None else [] for s in rows], len(rows), positions
            )
        }

    def _tables(self, a: dict):
        """A call's block tables as the programs take them: the full one, or both groups' (`paged.Tables`)."""
        return paged.Tables(a["pages"], a["window_pages"]) if "window_pages" in a else a["pages"]

    def _idle(self, rows: int, width: int):
        """Block tables [rows, width] that name no page (a warm-up's), in every group."""
        full = np.full((rows, width), self.kv.num_pages, np.int32)
        if self.window_kv is None:
            return full
        return paged.Tables(full, np.full((rows, width), self.window_kv.num_pages, np.int32))

    def _prefill_call(self, rows: list[int | None]) -> None:
        pages, tokens, start, last, after, valid = self._prefill_inputs(rows)
        requests = [self.slots[s].request if s is not None else None for s in rows]
        sampling, flags = sampling_rows(requests, self.prefill_rows)
        # every position's logits: only when needed
        echo = any(r is not None and r.echo_logprobs and not r.tokens for r in requests)
        forks = any(other is not None and other.leader is not None and other.leader in rows for other in self.slots)
        arrays = dict(
            pages=pages,
            **self._window_table(rows, int(start.max()) + self.chunk),
            tokens=tokens,
            start=start,
            last=last,
            after=after,
            **flat("sampling", sampling),
            **self._forced("prefill", valid.reshape(-1)),
        )
        out, lp, logits, picks = self._run(
            Call("prefill", arrays, dict(flags, prompt_logprobs=echo, observe=bool(self.pick_observers), logits=forks))
        )
        self._observe("prefill", picks, valid.reshape(-1))
        for i, r in enumerate(requests):
            if (
                r is not None and r.echo_logprobs and not r.tokens
            ):  # position t's entry is the logprob of prompt token t + 1
                r.record(lp["prompt"], i, prompt=True, at=slice(0, min(self.chunk, last[i] - start[i])))
        now = time.perf_counter()
        for i, s in self._advance_prefill(rows, self.chunk):
            r = self.slots[s].request
            if any(other is not None and other.leader == s for other in self.slots):
                self._fork_samples(s, logits[i], now)
            if r.max_tokens == 0:
                self._emit(s, None, now)
            else:
                if not r.tokens:
                    r.record(lp, i)
                self._start_decoding(s, int(out[i]), now)

    def _fork_samples(self, source: int, logits: np.ndarray, now: float) -> None:
        """The other samples of slot `source`'s prompt, now prefilled: each holds the prompt's full
        pages and a copy of its partly written last one, and draws its first token from the
        prompt's last logits [V] (through the host: with prefill apart they are on the other
        mesh) with its own seed."""
        leader = self.slots[source]
        forks = [s for s, slot in enumerate(self.slots) if slot is not None and slot.leader == source]
        n, none, ps, length = self.num_slots, self.kv.num_pages, self.kv.page_size, len(leader.seq)
        full = leader.pages[: length // ps]
        src, dst = np.full(n, none, np.int32), np.full(n, none, np.int32)  # padding: no page
        if length % ps:
            src[: len(forks)] = leader.pages[length // ps]
            dst[: len(forks)] = [self.slots[s].pages[0] for s in forks]
        windows = {}
        if self.window_kv is not None:  # the same in the window group: held pages, and a copy of the last
            wnone = self.window_kv.num_pages
            window = leader.window[: length // ps]
            wsrc, wdst = np.full(n, wnone, np.int32), np.full(n, wnone, np.int32)
            if length % ps:
                wsrc[: len(forks)] = leader.window[length // ps]
                wdst[: len(forks)] = [self.slots[s].window[0] for s in forks]
            windows = dict(window_src=wsrc, window_dst=wdst)
        requests = [self.slots[s].request for s in forks]
        sampling, _ = sampling_rows(requests, n, extras=True)
        out, lp = self._run(
            Call(
                "fork",
                dict(
                    src=src,
                    dst=dst,
                    **windows,
                    logits=logits,
                    positions=np.full(n, length, np.int32),
                    **flat("sampling", sampling),
                ),
            )
        )
        for i, s in enumerate(forks):
            slot, r = self.slots[s], requests[i]
            self.kv.hold(full)
            if self.window_kv is not None:
                self.window_kv.hold([p for p in window if p != wnone])
                slot.window = window + slot.window
            slot.pages, slot.leader, slot.done, slot.pos = full + slot.pages, None, length, length
            r.prompt_logprobs = leader.request.prompt_logprobs
            if r.max_tokens == 0:
                self._emit(s, None, now)
            else:
                r.record(lp, i)
                self._emit(s, int(out[i]), now)

    # ------------------------------------------------------------------ the calls, on every process
    def _run(self, call: Call):
        """One program call of the step plan: sent to the followers first (multi-host), then run here."""
        if self.link is not None:
            self.link.send(call)
        return self.execute(call)

    def execute(self, call: Call):
        return getattr(self, f"_do_{call.name}")(call.arrays, **call.flags)

    @staticmethod
    def _picks(picks: list, observe: bool) -> np.ndarray | None:
        return np.stack([to_host(p) for p in picks]) if observe and picks else None  # [L, R, k]

    def _do_decode(self, a: dict, greedy_only: bool, extras: bool, observe: bool):
        """-> (tokens [W], logprobs, picks [L, W, k] or None)."""
        out, lp, self.cache, picks = self._decode(
            self.engine.params,
            self.cache,
            self._tables(a),
            a["tokens"],
            a["positions"],
            nested(a, "sampling"),
            forced=a.get("forced"),
            greedy_only=greedy_only,
            extras=extras,
        )
        return to_host(out), {k: to_host(v) for k, v in lp.items()}, self._picks(picks, observe)

    def _do_prefill(self, a: dict, greedy_only: bool, extras: bool, prompt_logprobs: bool, observe: bool, logits: bool):
        """-> (tokens [P], logprobs, the last logits [P, V] if `logits` else None, picks or None)."""
        out, lp, last, self.prefill_into, picks = self._prefill(
            self.prefill_engine.params,
            self.prefill_into,
            self._tables(a),
            a["tokens"],
            a["start"],
            a["last"],
            a["after"],
            nested(a, "sampling"),
            forced=a.get("forced"),
            greedy_only=greedy_only,
            extras=extras,
            prompt_logprobs=prompt_logprobs,
        )
        out, lp = to_host(out), jax.tree.map(to_host, lp)
        if self.apart:
            self.handover_bytes += self._hand_over(self._tables(a), a["start"])
        return out, lp, to_host(last) if logits else None, self._picks(picks, observe)

    def _do_fork(self, a: dict):
        src, dst = a["src"], a["dst"]
        if "window_src" in a:
            src, dst = paged.Tables(src, a["window_src"]), paged.Tables(dst, a["window_dst"])
        out, lp, self.cache = self._fork_program(
            self.cache, src, dst, a["logits"], nested(a, "sampling"), a["positions"]
        )
        return to_host(out), {k: to_host(v) for k, v in lp.items()}

    def _do_move_experts(self, a: dict) -> int:
        return self.rebalancer.move(a["phy2log"])

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

    def _hand_over(self, pages, start: np.ndarray) -> int:
        """Prefill apart: the pages a prefill call wrote (those of block tables `pages` [P, W], or
        both groups' `paged.Tables`, holding chunk positions from `start` [P]) from the prefill
        pool into the decode pool, streamed call by call in a fixed shape -> bytes that changed device."""
        from moejax.engine.disaggregated import move_cache

        if isinstance(pages, paged.Tables):
            ids = paged.Tables(
                self.kv.chunk_pages(pages.full, start, self.chunk),
                self.window_kv.chunk_pages(pages.window, start, self.chunk),
            )
        else:
            ids = self.kv.chunk_pages(pages, start, self.chunk)
        pieces, moved = move_cache(
            self._take(self.prefill_cache, ids),
            self.engine.placement,
            list(self.prefill_engine.placement.mesh.devices.flat),
            pool=True,
        )
        self.cache = self._put(self.cache, ids, pieces)
        return moved

    def _forced(self, kind: str, valid: np.ndarray) -> dict:
        """A routing override's picks for a pass whose real rows are `valid`, as a call's input."""
        return {} if self.dealer is None else {"forced": self.dealer.picks(kind, valid)}  # int32 [L, R, k]

    def _observe(self, kind: str, ids: np.ndarray | None, valid: np.ndarray) -> None:
        """ids: the pass's picks [L, R, k] read back (None: no observer, or a model without MoE)."""
        if ids is not None:
            for observe in self.pick_observers:
                observe(kind, ids, valid)

    # ------------------------------------------------------------------ warm-up
    def warm_up(self) -> None:
        """Compiles every program a request can use (greedy, sampled, with logprobs / bias, with
        prompt logprobs, at every block-table width; the fork of n samples) on idle rows, which
        name no page and so write nothing. Every process runs it alike: all hold the same set."""
        p, n = self.prefill_rows, self.num_slots
        for greedy, extras in ((True, False), (False, False), (False, True)):
            for pw in self.kv.widths():
                for w in self.decode_widths():
                    sampling, _ = sampling_rows([], w, extras=extras)
                    picks = self._forced("decode", np.zeros(w, bool)).get("forced")  # host picks, as a real call's
                    _, _, self.cache, _ = self._decode(
                        self.engine.params,
                        self.cache,
                        self._idle(w, pw),
                        np.zeros(w, np.int32),
                        np.full(w, self.max_len, np.int32),
                        sampling,
                        forced=picks,
                        greedy_only=greedy,
                        extras=extras,
                    )
                for echo in (False, True) if extras else (False,):
                    sampling, _ = sampling_rows([], p, extras=extras)
                    zeros = np.zeros(p, np.int32)
                    out, _, logits, self.prefill_into, _ = self._prefill(
                        self.prefill_engine.params,
                        self.prefill_into,
                        self._idle(p, pw),
                        np.zeros((p, self.chunk), np.int32),
                        zeros,
                        zeros,
                        zeros,
                        sampling,
                        forced=self._forced("prefill", np.zeros(p * self.chunk, bool)).get("forced"),
                        greedy_only=greedy,
                        extras=extras,
                        prompt_logprobs=echo,
                    )
                    out.block_until_ready()
        sampling, _ = sampling_rows([], n, extras=True)
        nothing = self._idle(1, n)
        nothing = jax.tree.map(lambda t: t[0], nothing)  # ids [n] that name no page
        out, _, self.cache = self._fork_program(
            self.cache, nothing, nothing, to_host(logits)[0], sampling, np.zeros(n, np.int32)
        )
        out.block_until_ready()
        if self.apart:  # compiles the pages' move (padding rows only: nothing written)
            self._hand_over(self._idle(p, 1), np.zeros(p, np.int32))
