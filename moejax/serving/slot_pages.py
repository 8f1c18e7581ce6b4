"""Which pages each of the scheduler's slots holds as its request runs: a page taken as the
request crosses into one, and when its rank's pool has none the newest running request there
gives all of its pages back and waits to be computed again (vLLM's preemption by recompute), so
no request is lost and none reads another's pages.

A model with sliding-window layers keeps their pages apart (`window_kv`): a request holds a
window page only while some position of it may still be read, those before (next position -
window) go back to the pool as prefill chunks and decoding advance, and its window table names
no page there. Window pages are taken per chunk and per step as full ones are, and a rank short
of either preempts its newest request.
"""

from __future__ import annotations


class SlotPages:
    """The page half of `scheduler.Scheduler`'s host-side policy (its state: engine, kv,
    window_kv, slots, waiting, prefilling, chunk, writes_per_step, preemptions; `rank`)."""

    def _free(self, s: int) -> None:
        """Slot s's request out, and the samples waiting to fork from it: their pages back to the pool."""
        for f in [s] + [f for f, other in enumerate(self.slots) if other is not None and other.leader == s]:
            self.kv.release(self.slots[f].pages)
            if self.window_kv is not None:
                self.window_kv.release([p for p in self.slots[f].window if p != self.window_kv.num_pages])
            self.slots[f] = None
        if s in self.prefilling:
            self.prefilling.remove(s)

    def _grow(self, decoding: list[int]) -> list[int]:
        """Pages for the positions each decoding slot writes next, oldest request first; when the
        pool runs out, the newest running request gives its pages back and waits to be computed
        again (vLLM's preemption by recompute; the newest on the slot's rank: only its pages
        serve there) -> the slots that still decode."""
        for s in sorted(decoding, key=lambda s: self.slots[s].admitted):
            if self.slots[s] is not None:  # not preempted for an older one
                self._hold(s, self.slots[s].pos, self.slots[s].pos + self.writes_per_step)
        return [s for s in decoding if self.slots[s] is not None]

    def _preempt(self, rank: int) -> None:
        """The newest running request on `rank` gives its pages back and waits to be computed again."""
        victim = max(
            (
                v
                for v, other in enumerate(self.slots)
                if other is not None and other.leader is None and self.rank(v) == rank
            ),
            key=lambda v: self.slots[v].admitted,
        )
        r = self.slots[victim].request
        if not r.tokens:
            r.prompt_logprobs.clear()  # computed again with the prompt
        with self._cv:
            self.waiting.appendleft(r)
            self._free(victim)
        self.preemptions += 1

    def _take_pages(self, s: int, start: int, end: int) -> bool:
        """Slot s's pages for the positions start .. end - 1 it writes next (its window pages from
        start - window + 1 on, the earlier ones back to the pool): False when its rank has too few
        (what it could take, it keeps)."""
        slot, rank = self.slots[s], self.rank(s)
        if not self._extend(self.kv, slot.pages, end, rank):
            return False
        if self.window_kv is None:
            return True
        none, first = self.window_kv.num_pages, start - self.engine.c.sliding_window + 1
        gone = max(0, first) // self.kv.page_size  # pages whose every position precedes `first`
        self.window_kv.release([p for p in slot.window[:gone] if p != none])
        slot.window[:gone] = [none] * min(gone, len(slot.window))
        return self._extend(self.window_kv, slot.window, end, rank)

    def _extend(self, kv, held: list[int], end: int, rank: int) -> bool:
        """`held` (a slot's pages of `kv`'s group, in place) grown to hold positions up to `end`:
        False when the rank has too few."""
        need = self.kv.needed(end) - len(held)
        if need > 0:
            pages = kv.take(need, rank)
            if pages is None:
                return False
            held += pages
        return True

    def _hold(self, s: int, start: int, end: int) -> None:
        """Slot s's pages for positions start .. end - 1, preempting the newest request on its rank
        until they are there (slot s itself, when it is the newest: then it is gone)."""
        while self.slots[s] is not None and not self._take_pages(s, start, end):
            self._preempt(self.rank(s))

    def _window_for_prefill(self, rows: list[int | None]) -> list[int | None]:
        """A prefill call's rows with the window pages of their chunks (a rank short of them
        preempts its newest request; a row preempted so is a padding row)."""
        if self.window_kv is None:
            return rows
        for s in (s for s in rows if s is not None and self.slots[s] is not None):
            self._hold(s, self.slots[s].done, min(self.slots[s].done + self.chunk, len(self.slots[s].seq)))
        return [s if s is not None and self.slots[s] is not None else None for s in rows]
