"""Router picks of a model run as a trace: prefill chunks and decode steps of `Engine.generate`.

The picks are an output of the jitted step (`record=True`); this module only lays them out as
`save_trace`'s fields and marks the rows that are not a request's token: batch padding (requests
added to fill a batch bucket or a multiple of the devices) and, in a prefill chunk, positions past
a request's prompt.
"""

from __future__ import annotations

import numpy as np

from moejax.engine.routing import valid_rows


def model_trace(engine, prompts: list[list[int]], steps: int, model: str) -> dict:
    """`save_trace`'s fields for prefill of `prompts` then `steps` decode steps of greedy generation."""
    gen = engine.generate(prompts, steps + 1, record=True)  # the first new token comes from prefill
    chunk = engine.chunk_for(prompts)
    passes = [np.stack([np.asarray(p) for p in layers]) for layers in gen.picks]  # each int32[L, R_s, k]
    batch = passes[-1].shape[1]  # a decode step has one row per (padded) request
    num_prefill = len(passes) - steps
    lens = [len(p) for p in prompts]
    valid = [valid_rows(lens, batch, chunk, i * chunk) for i in range(num_prefill)]
    valid += [valid_rows(lens, batch, chunk, None)] * steps
    rows = max(p.shape[1] for p in passes)
    ids = np.zeros((len(passes), passes[0].shape[0], rows, passes[0].shape[2]), np.int32)  # [S, L, R, k]
    mask = np.zeros((len(passes), rows), bool)  # [S, R]
    for s, (p, v) in enumerate(zip(passes, valid)):
        ids[s, :, : p.shape[1]] = p
        mask[s, : p.shape[1]] = v
    c = engine.c
    return dict(
        ids=ids,
        valid=mask,
        kind=["prefill"] * num_prefill + ["decode"] * steps,
        layers=list(c.moe_layers),
        num_experts=c.num_experts,
        model=model,
    )
