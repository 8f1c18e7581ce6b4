"""The model's own log-probabilities: log-softmax of the logits in float32, the chosen token's
and the MAX_TOP best, as the OpenAI API's `logprobs` report them (computed only when asked)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP = 20  # the most alternatives a request may ask per token (OpenAI's limit)


def logprobs_of(logits: jax.Array, chosen: jax.Array) -> dict:
    """logits [..., V], chosen ids [...] -> {"chosen": [...], "top_ids": [..., MAX_TOP], "top": [..., MAX_TOP]}
    (best first)."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(lsm, min(MAX_TOP, logits.shape[-1]))
    return {"chosen": jnp.take_along_axis(lsm, chosen[..., None], axis=-1)[..., 0], "top_ids": top_ids, "top": top}


def biased(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits [B, V] plus values [B, K] at ids [B, K] (an id of V or more: padding, dropped)."""
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].add(values, mode="drop")


def prompt_logprobs(logits: np.ndarray, prompt: list[int], top: int) -> dict:
    """A prompt's logits [L, V] from one prefill -> each token's logprob given those before it
    (the first: null) and its `top` best alternatives as [id, logprob] pairs, as the server's echo."""
    out = {"tokens": list(prompt), "token_logprobs": [None], "top_logprobs": [None]}
    if len(prompt) > 1:
        lp = jax.device_get(logprobs_of(jnp.asarray(logits[:-1]), jnp.asarray(prompt[1:], jnp.int32)))
        out["token_logprobs"] += lp["chosen"].tolist()
        out["top_logprobs"] += [
            [[int(t), float(v)] for t, v in zip(ids[:top], values[:top])]
            for ids, values in zip(lp["top_ids"], lp["top"])
        ]
    return out
