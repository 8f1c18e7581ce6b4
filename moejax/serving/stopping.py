"""When a request stops, and the text it has produced so far.

One `Stopper` per request takes its new tokens one at a time (the scheduler calls it after every
step; `generate` replays a finished static batch through it) and answers with the text that may
be shown now. Text that could still be the start of a stop string, or an incomplete UTF-8
character, is held back until the next token decides it, so streamed pieces concatenate to
exactly the final text.
"""

from __future__ import annotations

from moejax.base.errors import UsageError

REPLACEMENT = "\ufffd"  # what a decoder writes for a UTF-8 sequence cut in the middle


class Stopper:
    """stop_ids: end-of-sequence and user stop ids (the token counts as generated, its text is
    not shown); stop_strings: the text ends before the first of them. `tokenizer` may be None
    (ids only: no text, no stop strings)."""

    def __init__(self, tokenizer, stop_ids=(), stop_strings=()):
        if stop_strings and tokenizer is None:
            raise UsageError("stop strings need a model with a tokenizer (tokenizer.json)")
        if any(not s for s in stop_strings):
            raise UsageError("a stop string is empty")
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.stop_strings = tuple(stop_strings)
        self.tokens: list[int] = []  # every generated token, a stop id included
        self._text_tokens: list[int] = []
        self.text = ""  # the text shown so far (sum of every delta)
        self.finish_reason: str | None = None

    def add(self, token: int) -> str:
        """Takes one new token; returns the text that may be shown now ("" if none). Sets
        `finish_reason` to "stop" when a stop id or stop string ends the request."""
        self.tokens.append(token)
        if token in self.stop_ids:
            return self._finish("stop", self._decoded())
        self._text_tokens.append(token)
        if self.tokenizer is None:
            return ""
        full = self._decoded()
        hits = [i for i in (full.find(s) for s in self.stop_strings) if i >= 0]
        if hits:
            return self._finish("stop", full[: min(hits)])
        return self._show(full[: len(full) - self._held(full)])

    def finish_length(self) -> str:
        """The request ran out of tokens or cache: shows whatever was held back."""
        return self._finish("length", self._decoded())

    def _decoded(self) -> str | None:
        return self.tokenizer.decode(self._text_tokens) if self.tokenizer is not None else None

    def _finish(self, reason: str, full: str | None) -> str:
        self.finish_reason = reason
        return self._show(full) if full is not None else ""

    def _show(self, upto: str) -> str:
        # The decoded text is prefix-stable once held-back tails are decided; guard anyway.
        delta = upto[len(self.text) :] if upto.startswith(self.text) else ""
        self.text += delta
        return delta

    def _held(self, full: str) -> int:
        """Characters at the end of `full` not to show yet."""
        if full.endswith(REPLACEMENT):
            return len(full) - len(full.rstrip(REPLACEMENT))
        longest = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(full)), longest, -1):
                if full.endswith(s[:n]):
                    longest = n
                    break
        return longest
