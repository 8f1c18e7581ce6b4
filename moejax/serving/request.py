"""A request to the scheduler, and the per-row arrays its device programs sample with.

Beyond temperature / top-p / top-k and a seed, a request may ask for the model's logprobs of its
new tokens (and of its prompt's, for echo), bias logits (`logit_bias`), hold back its stop ids
until `min_tokens` are out, and carry further samples of its prompt (n > 1) that are forked from
its cache after its one prefill. Rows that ask none of these run the plain programs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from moejax.base.errors import UsageError
from moejax.engine.logprobs import MAX_TOP
from moejax.serving.stopping import Stopper

MAX_BIAS = 512  # biased ids per row and step: logit_bias (at most 300) and, under min_tokens, the stop ids
BIAS_PAD = np.iinfo(np.int32).max  # an id past every vocabulary: the bias entry is dropped


@dataclasses.dataclass
class Request:
    prompt: list[int]
    max_tokens: int  # 0: no new token (echo: the prompt's logprobs only)
    stopper: Stopper
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    logprobs: int | None = None  # alternatives reported per token (0..MAX_TOP); None: no logprobs
    echo_logprobs: bool = False  # also each prompt token's logprob (after the first)
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    min_tokens: int = 0  # stop ids are held back until this many tokens are out
    samples: list[Request] = dataclasses.field(default_factory=list)  # n > 1: the others, forked after the prefill
    # on_event(token, delta_text, finished): after every new token, from the engine thread.
    on_event: Callable[[int | None, str, bool], None] | None = None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)  # when each new token was out
    finished: float | None = None
    cancelled: bool = False  # set by any thread (a client that went away); the next step drops it
    error: str | None = None  # the server failed it (a lost process): the HTTP side answers 503
    # Logprobs when asked: (logprob, [(id, logprob)] best first) per new token, and per prompt token after the first.
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.stopper.tokens

    @property
    def finish_reason(self) -> str | None:
        return self.stopper.finish_reason

    @property
    def extras(self) -> bool:
        """Whether its rows need the programs with logit bias and logprobs."""
        return self.logprobs is not None or bool(self.logit_bias) or len(self.tokens) < self.min_tokens

    def bias(self) -> dict[int, float]:
        """The logit bias of its next token: logit_bias, and -inf on the stop ids before min_tokens."""
        if len(self.tokens) >= self.min_tokens:
            return self.logit_bias
        return {**self.logit_bias, **{t: -np.inf for t in self.stopper.stop_ids}}

    def record(self, lp: dict, i: int, prompt: bool = False, at: slice | None = None) -> None:
        """Appends row i's logprobs from a program's host copy (`at`: positions of a prompt chunk)."""
        if self.logprobs is None:
            return
        n = self.logprobs
        if prompt:
            for j in range(at.start, at.stop):
                self.prompt_logprobs.append((float(lp["chosen"][i, j]), _top(lp, (i, j), n)))
        else:
            self.token_logprobs.append((float(lp["chosen"][i]), _top(lp, i, n)))


def _top(lp: dict, at, n: int) -> list[tuple[int, float]]:
    return [(int(t), float(v)) for t, v in zip(lp["top_ids"][at][:n], lp["top"][at][:n])]


def sampling_rows(requests: list[Request | None], n: int, extras: bool = False) -> tuple[dict, dict]:
    """Per-row sampling arrays for n rows (rows past the requests, or None: greedy padding) and the
    programs' static flags. extras: the bias arrays even when no row asks."""
    temperature, top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
    top_k, seeds = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for i, r in enumerate(requests):
        if r is not None:
            temperature[i], top_p[i], top_k[i], seeds[i] = r.temperature, r.top_p, r.top_k, r.seed
    arrays = dict(temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds)
    extras = extras or any(r is not None and r.extras for r in requests)
    if extras:
        ids, values = np.full((n, MAX_BIAS), BIAS_PAD, np.int32), np.zeros((n, MAX_BIAS), np.float32)
        for i, r in enumerate(requests):
            if r is not None:
                bias = r.bias()
                ids[i, : len(bias)], values[i, : len(bias)] = list(bias), list(bias.values())
        arrays.update(bias_ids=ids, bias=values)
    # With extras the sort is compiled anyway: one program serves greedy and sampled rows.
    return arrays, dict(greedy_only=bool((temperature == 0).all()) and not extras, extras=extras)


def check_request(request: Request, vocab: int, max_len: int, slots: int) -> None:
    """Raises UsageError for a request that can never run: `max_len` the longest request, `slots` decoding at once."""
    if not request.prompt:
        raise UsageError("the prompt is empty")
    bad = [t for t in request.prompt if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    if len(request.prompt) >= max_len:
        raise UsageError(
            f"prompt of {len(request.prompt)} tokens does not fit the longest request of {max_len} "
            f"positions (--max-seq-len)"
        )
    if request.max_tokens < 0:
        raise UsageError(f"max_tokens must be at least 0, got {request.max_tokens}")
    if request.temperature < 0 or request.top_k < 0 or not 0 < request.top_p <= 1:
        raise UsageError("sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP:
        raise UsageError(f"logprobs must be 0..{MAX_TOP}, got {request.logprobs}")
    if 1 + len(request.samples) > slots:
        raise UsageError(f"n={1 + len(request.samples)} samples need as many slots; this server has {slots}")
    if len(request.logit_bias) + len(request.stopper.stop_ids) * (request.min_tokens > 0) > MAX_BIAS:
        raise UsageError(f"at most {MAX_BIAS} biased ids (logit_bias, and the stop ids under min_tokens)")
    bad = [t for t in request.logit_bias if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"logit_bias token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
