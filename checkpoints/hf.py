"""Import a transformers `save_pretrained` directory (config.json + safetensors).

Tensor names are those transformers writes to disk: per-expert
`mlp.experts.{i}.{gate,up,down}_proj` (Qwen3-MoE, GLM-4.5, DeepSeek-V3) and Mixtral's
`block_sparse_moe.experts.{i}.w1/w2/w3`; the fused in-memory layout
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) is accepted too. Gate and up become one
gate_up matrix, columns interleaved (`checkpoints.gate_up`). Linear weights are
stored [out, in] by torch; ours are [in, out], split per head where attention needs it.
A DeepSeek-V3 / GLM checkpoint may carry the MTP module as one extra layer after the last,
`model.layers.{num_layers}.*` (enorm, hnorm, eh_proj, shared_head.norm, a decoder layer);
transformers drops it, `load_hf_mtp` reads it. gpt-oss keeps its experts fused
(`mlp.experts.gate_up_proj` [E, D, 2F], gate and up interleaved, with biases) and its router at
`mlp.router`. Quantized checkpoints (FP8, NVFP4, MXFP4) are read through
`checkpoints.quantization.Tensors`: the thunks see floats, or 4-bit experts as published.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from checkpoints.gate_up import fuse
from checkpoints.hf_config import from_hf_config
from checkpoints.placing import Layers, place_tensor
from checkpoints.quantization import Tensors, read_scheme
from checkpoints.safetensors_io import SafetensorsDir
from moejax.base.errors import UsageError
from moejax.config import ConfigError, ModelConfig
from moejax.model import layer_loop
from moejax.model.mtp import mtp_specs
from moejax.model.params import ParamSpec, Run, layer_runs, param_specs


def read_hf_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise UsageError(f"{directory}: no such directory")
    if not path.is_file():
        raise UsageError(f"{directory}: no config.json")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{path}: not valid JSON") from None
    try:
        cfg = from_hf_config(hf)
    except ConfigError as e:
        raise UsageError(f"{path}: {e}") from None
    cfg.validate()
    read_scheme(directory)  # a quantization this runtime does not read ends here, in one line
    return cfg


def expert_format(directory: str | Path, wanted: str) -> str:
    """The expert format a run of `directory` uses: experts published 4-bit stay in their
    format (bit for bit); others are `wanted` (the run dtype, or quantized on load)."""
    native = read_scheme(directory)
    native = native.expert_format if native else None
    if native is None:
        return wanted
    if wanted not in ("unquantized", native):
        raise UsageError(
            f"{directory} holds {native} experts, not {wanted}; they run as published (--expert-format {native})"
        )
    return native


def _linear(st: Tensors, name: str) -> np.ndarray:
    """torch Linear weight [out, in] -> [in, out]."""
    return st.get(name + ".weight").T


def _attention(st: Tensors, pre: str, c: ModelConfig) -> dict[str, Callable[[], np.ndarray]]:
    h, d = c.num_heads, c.hidden_size
    if c.is_mla:

        def kv_b(part: slice):
            w = st.get(pre + "kv_b_proj.weight").reshape(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            return w[:, part].transpose(2, 0, 1)  # [R, H, dim]

        return {
            "q_a": lambda: _linear(st, pre + "q_a_proj"),
            "q_a_norm": lambda: st.get(pre + "q_a_layernorm.weight"),
            "q_b": lambda: _linear(st, pre + "q_b_proj").reshape(c.q_lora_rank, h, c.qk_head_dim),
            "q": lambda: _linear(st, pre + "q_proj").reshape(d, h, c.qk_head_dim),
            "kv_a": lambda: _linear(st, pre + "kv_a_proj_with_mqa"),
            "kv_a_norm": lambda: st.get(pre + "kv_a_layernorm.weight"),
            "w_uk": lambda: kv_b(slice(0, c.qk_nope_head_dim)),
            "w_uv": lambda: kv_b(slice(c.qk_nope_head_dim, None)),
            "o": lambda: _linear(st, pre + "o_proj").reshape(h, c.v_head_dim, d),
            "indexer": {
                "wq": lambda: _linear(st, pre + "indexer.wq_b").reshape(
                    c.q_lora_rank, c.index_n_heads, c.index_head_dim
                ),
                "wk": lambda: _linear(st, pre + "indexer.wk"),
                "k_norm": lambda: st.get(pre + "indexer.k_norm.weight"),
                "k_norm_bias": lambda: st.get(pre + "indexer.k_norm.bias"),
                "head_weights": lambda: _linear(st, pre + "indexer.weights_proj"),
            },
        }
    kv, dh = c.num_kv_heads, c.head_dim
    return {
        "q": lambda: _linear(st, pre + "q_proj").reshape(d, h, dh),
        "k": lambda: _linear(st, pre + "k_proj").reshape(d, kv, dh),
        "v": lambda: _linear(st, pre + "v_proj").reshape(d, kv, dh),
        "o": lambda: _linear(st, pre + "o_proj").reshape(h, dh, d),
        "q_bias": lambda: st.get(pre + "q_proj.bias").reshape(h, dh),
        "k_bias": lambda: st.get(pre + "k_proj.bias").reshape(kv, dh),
        "v_bias": lambda: st.get(pre + "v_proj.bias").reshape(kv, dh),
        "o_bias": lambda: st.get(pre + "o_proj.bias"),
        "sinks": lambda: st.get(pre + "sinks"),
        "q_norm": lambda: st.get(pre + "q_norm.weight"),
        "k_norm": lambda: st.get(pre + "k_norm.weight"),
    }


def _mlp(st: Tensors, pre: str) -> dict[str, Callable[[], np.ndarray]]:
    return {
        "gate_up": lambda: fuse(_linear(st, pre + "gate_proj"), _linear(st, pre + "up_proj")),
        "down": lambda: _linear(st, pre + "down_proj"),
    }


def _gpt_oss_experts(st: Tensors, pre: str) -> dict[str, Callable[[], np.ndarray]]:
    """gpt-oss: gate_up_proj [E, D, 2F] with gate and up interleaved along 2F (and its bias
    [E, 2F]), down_proj [E, F, D]; or, as released, MXFP4 `*_blocks` / `*_scales` [E, N, ...].
    Its interleave is ours (`gate_up_columns`): read as published."""
    if pre + "gate_up_proj_blocks" in st:
        weights = {
            "gate_up": lambda: st.mxfp4_experts(pre + "gate_up_proj"),
            "down": lambda: st.mxfp4_experts(pre + "down_proj"),
        }
    else:
        weights = {"gate_up": lambda: st.get(pre + "gate_up_proj"), "down": lambda: st.get(pre + "down_proj")}
    return weights | {
        "gate_up_bias": lambda: st.get(pre + "gate_up_proj_bias"),
        "down_bias": lambda: st.get(pre + "down_proj_bias"),
    }


def _experts(st: Tensors, pre: str, c: ModelConfig) -> dict[str, Callable[[], np.ndarray]]:
    if c.family == "gpt_oss":
        return _gpt_oss_experts(st, pre)
    f = c.moe_intermediate_size
    names = (
        {"gate": "w1", "up": "w3", "down": "w2"}
        if c.family == "mixtral"
        else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    )
    fused = pre + "gate_up_proj" in st
    linears = lambda part: [f"{pre}{e}.{names[part]}" for e in range(c.num_experts)]

    def per_expert(part: str) -> np.ndarray:
        if fused:
            if part == "down":
                return st.get(pre + "down_proj").transpose(0, 2, 1)  # [E, D, F] -> [E, F, D]
            w = st.get(pre + "gate_up_proj")  # [E, 2F, D]: gate rows, then up rows
            return (w[:, :f] if part == "gate" else w[:, f:]).transpose(0, 2, 1)
        return st.experts(linears(part))

    def gate_up():
        if fused:
            return fuse(per_expert("gate"), per_expert("up"))
        return _gate_up(st, linears("gate"), linears("up"))

    return {"gate_up": gate_up, "down": lambda: per_expert("down")}


def _gate_up(st: Tensors, gates: list[str], ups: list[str]):
    """Per-expert gate and up linears -> [E, D, 2F] as `fuse` makes it: floats written into the
    interleaved buffer as each expert is read (no stack of either half on the way), NVFP4 experts
    fused from their two stacks."""
    if st.packed(gates + ups):
        return fuse(st.experts(gates), st.experts(ups))
    first = [st.get(names[0] + ".weight") for names in (gates, ups)]
    (f, d), dtype = first[0].shape, np.result_type(*first)
    out = np.empty((len(gates), d, f, 2), dtype)
    for e, names in enumerate(zip(gates, ups)):
        for half, name in enumerate(names):
            out[e, :, :, half] = st.get(name + ".weight").T
    return out.reshape(len(gates), d, 2 * f)


def _layer(st: Tensors, i: int, c: ModelConfig) -> dict:
    """The same tree as `layer_specs(c, i)`, each leaf a thunk that reads that parameter."""
    pre = f"model.layers.{i}."
    layer = {
        "attn_norm": lambda: st.get(pre + "input_layernorm.weight"),
        "attn": _attention(st, pre + "self_attn.", c),
        "mlp_norm": lambda: st.get(pre + "post_attention_layernorm.weight"),
    }
    if i in c.dense_layers:
        layer["mlp"] = _mlp(st, pre + "mlp.")
    else:
        m = pre + ("block_sparse_moe." if c.family == "mixtral" else "mlp.")
        router, bias = ("router", "router.bias") if c.family == "gpt_oss" else ("gate", "gate.e_score_correction_bias")
        layer["moe"] = {
            "router": lambda: _linear(st, m + router),
            "router_bias": lambda: st.get(m + bias),
            "experts": _experts(st, m + "experts.", c),
            "shared": _mlp(st, m + "shared_experts."),
        }
    return layer


def _run(st: Tensors, run: Run, c: ModelConfig) -> dict:
    """The same tree as a run's stacked specs: each leaf reads that parameter layer by layer."""
    per_layer = [_layer(st, i, c) for i in run.layers]
    return jax.tree.map(lambda *reads: Layers(reads), *per_layer)


def _mtp_sources(st: Tensors, c: ModelConfig) -> dict:
    """The same tree as `mtp_specs(c)`: the layer after the last decoder layer."""
    pre = f"model.layers.{c.num_layers}."
    return {
        "enorm": lambda: st.get(pre + "enorm.weight"),
        "hnorm": lambda: st.get(pre + "hnorm.weight"),
        "eh_proj": lambda: _linear(st, pre + "eh_proj"),
        "layer": _layer(st, c.num_layers, c),
        "norm": lambda: st.get(pre + "shared_head.norm.weight"),
    }


def _sources(st: Tensors, c: ModelConfig) -> dict:
    """The same tree as `param_specs`, each leaf a thunk that reads that parameter."""
    return {
        "embed": lambda: st.get("model.embed_tokens.weight"),
        "layers": [_run(st, run, c) for run in layer_runs(c)],
        "final_norm": lambda: st.get("model.norm.weight"),
        "lm_head": lambda: _linear(st, "lm_head"),
    }


def iter_hf_tensors(
    directory: str | Path, c: ModelConfig, mtp: bool = False
) -> Iterator[tuple[tuple, ParamSpec, object]]:
    """Yields (path in the param tree, spec, source) one parameter at a time: the model's, or
    with `mtp` the MTP module's. A source is a float numpy array or `PackedExperts` (experts
    published 4-bit), or for a run's stacked parameter `Layers` that read it layer by layer."""
    st = Tensors(directory)
    specs, sources = (mtp_specs(c), _mtp_sources(st, c)) if mtp else (param_specs(c), _sources(st, c))

    def checked(read, shape, path):
        array = read()
        if array.shape != shape:
            raise UsageError(
                f"{directory}: {'/'.join(map(str, path))} has shape {array.shape}, config.json implies {shape}"
            )
        return array

    def walk(spec_tree, src_tree, path):
        if isinstance(spec_tree, ParamSpec):
            if isinstance(src_tree, Layers):
                layer = spec_tree.shape[1:]
                yield (
                    path,
                    spec_tree,
                    Layers(
                        tuple(
                            functools.partial(checked, read, layer, path + (i,))
                            for i, read in enumerate(src_tree.reads)
                        )
                    ),
                )
            else:
                yield path, spec_tree, checked(src_tree, spec_tree.shape, path)
            return
        items = spec_tree.items() if isinstance(spec_tree, dict) else enumerate(spec_tree)
        for k, sub in items:
            yield from walk(sub, src_tree[k], path + (k,))

    yield from walk(specs, sources, ())


def set_path(tree, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def has_mtp(directory: str | Path, c: ModelConfig) -> bool:
    """Whether the checkpoint carries the MTP module (the layer after the last)."""
    return f"model.layers.{c.num_layers}.eh_proj.weight" in SafetensorsDir(directory)


def load_hf(directory: str | Path, c: ModelConfig, dtype, placement, mtp: bool = False, loops: tuple | None = None):
    """Params (with `mtp`: the MTP module's): every tensor read, cast and put on its devices
    by `placement` before the next one is read, each run of layers held by its loop of `loops`
    (default: stacked)."""
    loops = loops or layer_loop.stacked(c)
    params = jax.tree.map(
        lambda s: None, mtp_specs(c) if mtp else param_specs(c), is_leaf=lambda x: isinstance(x, ParamSpec)
    )
    for path, spec, array in iter_hf_tensors(directory, c, mtp):
        set_path(params, path, place_tensor(placement, spec, array, dtype, layer_loop.holds(loops, path)))
    return layer_loop.assemble(params, loops)
