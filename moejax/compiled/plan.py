"""`moejax plan`: the full-size model on N devices, compiled without the hardware (the verb's
arguments and tables: `moejax/verbs/plan_command.py`; its programs serve `advise --target` too).

Lowers and compiles the decode step (a batch of `--batch` requests over a KV cache of
`--context` positions), a decode block (`engine.decode_block` steps in one program) and one
prefill chunk (`--prefill-chunk` tokens over the devices) with abstract weights:
`jax.ShapeDtypeStruct`s carrying their `NamedSharding`s, so nothing is allocated. Reports per
placement and device the parameter bytes, the KV-cache bytes and the compiled programs'
temporary bytes (`compiled.memory_analysis()`), their total against the device's memory, whether
each program compiled, and the compile time.

`--target h100` (`moejax.base.targets`: h100, h200, b200, v5e, v6e) compiles on compile-only devices
of that accelerator with its own compiler (XLA:GPU and its Triton lowering through jax's CUDA
plugin, the TPU compiler and Mosaic through libtpu): the programs, kernels, collectives and
temporaries are the target's. Without one, the programs compile for N virtual CPU devices:
the same programs, but XLA:CPU's buffer assignment, which computes bf16 dots in f32 and hoists
the weights' converts out of the layer loop, so in bf16 about twice the non-expert parameter
bytes show up as temporaries (glm-5.3 on 8 devices, decode: 73 GB in bf16, 14 GB in f32).
Parameters and KV cache are exact either way: they are the shards each device holds.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from moejax.base import targets
from moejax.base.errors import UsageError
from moejax.base.platform import Platform, resolve, run_dtype
from moejax.compiled import hlo
from moejax.compiled.abstract_arrays import (
    abstract_cache,
    abstract_mtp_pool,
    abstract_params,
    abstract_pool,
    bytes_per_device,
    expert_leaves,
    in_loops,
    layer_weight_shapes,
)
from moejax.config import Config
from moejax.engine.pages import pages_for
from moejax.engine.programs import jit_program
from moejax.engine.sampling import Sampling
from moejax.engine.steps import decode_step, decode_steps, prefill
from moejax.model import paged
from sharding import make_placement

GB = 1e9
# The page pool's figures: positions per page, and the requests it is asked to fit (the load
# "How a Row Meets Its Experts" measures: 1,000-token prompts, 150 new tokens).
PAGE_SIZE, PROMPT_LEN, OUTPUT_LEN = 16, 1000, 150


def kv_pages(
    config: Config, placement, free_bytes: float, page_size: int, prompt_len: int, output_len: int, mtp: bool = False
) -> dict:
    """The page pool that `free_bytes` per device hold, and the requests of prompt_len +
    output_len positions it fits: under DP attention each device (a rank) holds whole pages of
    its own requests; under TP attention every device holds its slice of every page's heads
    (all of MLA's latent: it has no heads). `mtp`: MTP drafts, whose layer has a pool of as many
    pages. Sliding-window layers' pages are a group of their own: a request holds at most
    `kv_pages.window_held` of them, so the requests that fit pay for both groups' pages and the
    full group's pages are what the window group's leave."""
    from moejax.serving.kv_pages import window_held
    from moejax.serving.scheduler import SERVE_PREFILL_CHUNK

    ranks = placement.batch_multiple()  # DP attention: each device its own pool
    pool = abstract_pool(config, placement, ranks, page_size, ranks)  # one page per rank in each group
    group = lambda window: [{k: a for k, a in run.items() if paged.in_window(k) == window} for run in pool]
    probe = [group(False)]
    probe += [abstract_mtp_pool(config, placement, ranks, page_size)] if mtp else []
    page_bytes = bytes_per_device(probe)  # what a page costs the device holding it (its share of one)
    length = prompt_len + output_len
    per_request = pages_for(length, page_size)
    free = max(0.0, free_bytes)
    out = {
        "page_size": page_size,
        "page_bytes_per_device": page_bytes,
        "pages_per_request": per_request,
        "ranks": ranks,
    }
    if not config.model.sliding_layers:
        pages = int(free // page_bytes)
        return {
            **out,
            "pages_per_device": pages,
            "requests_per_rank": pages // per_request,
            "requests": ranks * (pages // per_request),
        }
    window_bytes = bytes_per_device(group(True))
    window_per_request = window_held(
        config.model, page_size, config.engine.prefill_chunk or SERVE_PREFILL_CHUNK, length
    )
    fit = int(free // (per_request * page_bytes + window_per_request * window_bytes))  # requests per rank
    window_pages = fit * window_per_request
    pages = int((free - window_pages * window_bytes) // page_bytes)
    return {
        **out,
        "pages_per_device": pages,
        "requests_per_rank": fit,
        "requests": ranks * fit,
        "window_page_bytes_per_device": window_bytes,
        "window_pages_per_device": window_pages,
        "window_pages_per_request": window_per_request,
    }


def compile_program(jitted, args, persist: bool = True) -> tuple:
    """(the compiled program or None, seconds, the first line of why it did not compile or None).
    `persist`: through jax's persistent compile cache; a compile-only target's program cannot be
    loaded back from it (it has no devices to load onto), so its compiles do not go there."""
    t0 = time.perf_counter()
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", was and persist)
    try:
        with targets.lowering(*args):
            compiled = jitted.lower(*args).compile()
    except Exception as e:  # whether it compiles is the answer; the reason is the report
        return None, time.perf_counter() - t0, (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
    return compiled, time.perf_counter() - t0, None


def _rows(placement, b: int):
    return jax.ShapeDtypeStruct((b,), jnp.int32, sharding=placement.sharding(("batch",), (b,)))


def _planned_loops(config: Config, platform: Platform) -> Config:
    """The layer loops a program runs at full size: on an accelerator the engine's (a GPU unrolls
    every run, a TPU scans: `Platform.unrolls`); where `Platform.plan_scans` (XLA:CPU) each run one
    scan over its stacked weights."""
    if not platform.plan_scans:
        return config
    if config.engine.layer_loop == "unroll":
        raise UsageError(
            "plan compiles each run of layers as a scan over its stacked weights on the CPU; "
            "engine.layer_loop unroll is not planned there"
        )
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, layer_loop="scan"))


def decode_kernels(text: str, params: dict, layers: int) -> dict:
    """A compiled decode step's kernel launches (`hlo.launches`, by kind) and the temporaries it
    writes of a layer weight's shape (`hlo.weight_shaped`: a weight copied, or a product spelled out
    as a multiply and a reduce), per call and per layer of the model's `layers`."""
    launches = hlo.launches(text)
    total = sum(r.count for r in launches)
    temporaries = sum(r.count for r in hlo.weight_shaped(text, layer_weight_shapes(params)))
    return {
        "launches": round(total, 1),
        "launches_per_layer": round(total / layers, 1),
        "launch_kinds": {kind: round(n, 1) for kind, n in hlo.by_kind(launches).items()},
        "weight_shaped": round(temporaries, 1),
        "weight_shaped_per_layer": round(temporaries / layers, 1),
    }


def pallas_figures(text: str, t: targets.Target) -> list[dict]:
    """Each distinct Pallas kernel call of a compiled program on target `t` (a layer's kernels repeat
    in every layer: `calls` counts a call's runs): its name (the named scope it was traced under and
    a Triton call's kernel function), its programs against the target's SMs, the bytes of its
    operands (what it reads, or at most that: `hlo.Instr.operand_bytes`) and their time at the
    datasheet bandwidth. A decode kernel streaming its weights fills the GPU with a program or more
    per SM; fewer leave SMs idle for the whole call."""
    sms = (targets.target(t.compiles_as) if t.compiles_as else t).cores
    found = {}
    for r in hlo.pallas_calls(text):
        i = r.instr
        name = " ".join(n for n in (i.kernel, i.function) if n)
        key = (name, i.programs, i.operand_bytes)
        if key not in found:
            found[key] = {
                "kernel": name,
                "programs": i.programs,
                "sms": sms,
                "bytes": int(i.operand_bytes),
                "us": round(i.operand_bytes / (t.hbm_tb_s * 1e12) * 1e6, 2),
                "calls": 0,
            }
        found[key]["calls"] += r.count
    return list(found.values())


def decode_program(
    config: Config,
    batch: int,
    context: int,
    platform: str | None = None,
    page_size: int = 0,
    devices: list | None = None,
):
    """(placement, the decode step bound to it, its abstract arguments) for `platform` (jax's name:
    a target's "cuda" or "tpu"; default this machine's): over a contiguous cache, or (`page_size`) a
    page pool of the same positions and its block tables; on `devices` (default: this machine's; a
    target's compile-only devices, `moejax.base.targets`). The engine's jit of the step is
    `jit_program(step, dtype, placement.platform, decode=True, donate_argnums=1)`: its precision
    and compiler options."""
    record = resolve(platform)
    placement = make_placement(_planned_loops(config, record), record, devices)
    multiple = placement.batch_multiple()
    if batch % multiple:
        raise UsageError(f"--batch {batch} must be a multiple of {multiple} (requests split over the devices)")
    step = functools.partial(decode_step, sampling=Sampling(), record=False, c=config.model, placement=placement)
    rows = [_rows(placement, batch) for _ in range(3)] + [jax.ShapeDtypeStruct((), jnp.int32)]
    params = in_loops(abstract_params(config, placement), placement)
    if not page_size:
        return placement, step, (params, abstract_cache(config, placement, batch, context), *rows)
    per_row = pages_for(context, page_size)
    table = jax.ShapeDtypeStruct(
        (batch, per_row), jnp.int32, sharding=placement.sharding(("batch", None), (batch, per_row))
    )
    return placement, step, (params, abstract_pool(config, placement, batch * per_row, page_size), *rows, None, table)


def programs(
    config: Config,
    batch: int,
    context: int,
    prefill_chunk: int,
    platform: str | None = None,
    devices: list | None = None,
    page_size: int = 0,
) -> tuple:
    """(placement, {program: (its jit as the engine makes it, its abstract arguments)}) of the
    engine's programs at full size for `platform` on `devices`: "decode" (one step of `batch`
    requests over `context` positions, a contiguous cache or pages of `page_size`), "decode block"
    (`engine.decode_block` steps in one program) and "prefill" (a chunk of `prefill_chunk` tokens
    over the devices: one request per device under DP attention)."""
    placement, step, (params, cache, tokens, lens, seeds, first, *paged_rest) = decode_program(
        config, batch, context, platform, page_size, devices
    )
    bind = dict(c=config.model, placement=placement)
    multiple = placement.batch_multiple()
    per_row = -(-prefill_chunk // multiple)
    chunk_tokens = jax.ShapeDtypeStruct(
        (multiple, per_row), jnp.int32, sharding=placement.sharding(("batch", "seq"), (multiple, per_row))
    )
    if page_size:  # the chunk's requests' pages: a pool of as many and their block tables
        per_request = pages_for(context, page_size)
        chunk_cache = abstract_pool(config, placement, multiple * per_request, page_size)
        chunk_pages = [
            jax.ShapeDtypeStruct(
                (multiple, per_request),
                jnp.int32,
                sharding=placement.sharding(("batch", None), (multiple, per_request)),
            )
        ]
    else:
        chunk_cache, chunk_pages = abstract_cache(config, placement, multiple, context), []
    block = functools.partial(decode_steps, block=config.engine.decode_block, sampling=Sampling(), **bind)
    jit = functools.partial(
        jit_program,
        dtype=placement.platform.run_dtype(config.engine.dtype),
        platform=placement.platform,
        donate_argnums=1,
    )
    pages = paged_rest[1:]  # the block table, after decode_step's `forced` (None)
    return placement, {
        "decode": (jit(step, decode=True), (params, cache, tokens, lens, seeds, first, *paged_rest)),
        "decode block": (jit(block, decode=True), (params, cache, tokens, lens, seeds, first, first, *pages)),
        "prefill": (
            jit(functools.partial(prefill, all_logits=False, record=False, **bind)),
            (params, chunk_cache, chunk_tokens, first, _rows(placement, multiple), None, *chunk_pages),
        ),
    }


def plan_placement(
    config: Config,
    batch: int,
    context: int,
    prefill_chunk: int,
    hbm_gb: float,
    page_size: int = PAGE_SIZE,
    prompt_len: int = PROMPT_LEN,
    output_len: int = OUTPUT_LEN,
    mtp: bool = False,
    target: str | None = None,
) -> dict:
    """One placement's per-device bytes and compile times (`config.layout` names it), for
    `target`'s compile-only devices (else this machine's), the page pool of `page_size`
    positions the memory left after the weights and temporaries holds (`kv_pages`), and on a
    target, its decode step's kernels (`decode_kernels`, and each Pallas kernel's figures under
    "kernels": `pallas_figures`; None on this machine's XLA:CPU)."""
    t = targets.target(target) if target else None
    devices = list(targets.devices(t.name, config.layout.devices)) if t else None
    placement, progs = programs(config, batch, context, prefill_chunk, t and t.platform, devices)
    params, cache = progs["decode"][1][:2]
    compiled, kernels = {}, None
    for name, (jitted, args) in progs.items():
        program, seconds, error = compile_program(jitted, args, persist=t is None)
        if name == "decode" and program is not None and t:  # XLA:CPU's kernels are not a target's
            text = program.as_text()
            kernels = {**decode_kernels(text, params, config.model.num_layers), "kernels": pallas_figures(text, t)}
        compiled[name] = {
            "compiled": program is not None,
            "compile_s": round(seconds, 1),
            "temp_bytes": int(program.memory_analysis().temp_size_in_bytes) if program else None,
            **({"error": error} if error else {}),
        }
    param_bytes, kv_bytes = bytes_per_device(params), bytes_per_device(cache)
    temp = max((p["temp_bytes"] for p in compiled.values() if p["compiled"]), default=0)
    total = param_bytes + kv_bytes + temp
    experts = expert_leaves(params)
    act_bytes = jnp.dtype(run_dtype(config.engine.dtype)).itemsize
    multiple = placement.batch_multiple()
    buffers = {
        phase: sum(placement.exchange_buffer_bytes(rows, config.model.hidden_size, act_bytes).values())
        for phase, rows in (("decode", batch), ("prefill", multiple * -(-prefill_chunk // multiple)))
    }
    return {
        "name": placement.name,
        "ep": placement.ep,
        "tp": placement.tp,
        "kernel": placement.kernel,
        "param_bytes_per_device": param_bytes,
        "expert_bytes_per_device": bytes_per_device(experts),
        "kv_cache_bytes_per_device": kv_bytes,
        "temp_bytes_per_device": int(temp),
        # The exchange's own buffers of one MoE layer (part of temp): sized for the worst case.
        "exchange_buffer_bytes_per_device": buffers,
        "total_bytes_per_device": int(total),
        "fits": bool(total <= hbm_gb * GB),
        "programs": compiled,
        "compiled": all(p["compiled"] for p in compiled.values()),
        "compile_s": round(sum(p["compile_s"] for p in compiled.values()), 1),
        "decode_kernels": kernels,
        "kv_pages": kv_pages(
            config, placement, hbm_gb * GB - param_bytes - temp, page_size, prompt_len, output_len, mtp
        ),
    }
