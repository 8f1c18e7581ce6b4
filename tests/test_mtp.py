"""MTP speculative decoding: greedy equals plain greedy (single device and placements), sampled
output follows the target's distribution, the jitted step has no host transfer, and MTP weights
load from checkpoints that carry them (DeepSeek-V3's extra layer)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from scipy import stats

from moejax.cli import main
from moejax.compiled import hlo
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from moejax.engine.disaggregated import Disaggregated
from moejax.engine.engine import Engine
from moejax.engine.kv_cache import init_cache
from moejax.engine.sampling import Sampling, sampling_logits
from moejax.engine.speculative import SpeculativeEngine, verify
from moejax.launch.loading import load_mtp, load_params
from moejax.model.mtp import init_mtp_cache, mirrored_draft
from moejax.model.transformer import layer_params
from sharding import make_placement

RNG = np.random.RandomState(0)
PROMPTS = [RNG.randint(0, 512, 40).tolist(), RNG.randint(0, 512, 23).tolist()]
ONE_LAYER = dataclasses.replace(preset("tiny-glm5"), num_layers=1, dense_layers=(), dsa_shared_layers=())


@functools.cache
def _mirror(layout: LayoutConfig, first: int = 0) -> SpeculativeEngine:
    """One-layer GLM-5 target with a draft that mirrors its layer: most drafts are accepted.
    On devices first .. first + layout.devices - 1."""
    config = Config(model=ONE_LAYER, layout=layout).validate()
    placement = make_placement(
        config, devices=jax.devices()[first : first + layout.devices] if layout.devices > 1 else None
    )
    params, mtp = mirrored_draft(load_params(config, placement), config.model)
    return SpeculativeEngine(Engine(config, params, placement), mtp)


@functools.cache
def _random_draft(model: str) -> SpeculativeEngine:
    """A random draft: nearly every draft is rejected."""
    config = Config(model=preset(model), engine=EngineConfig(prefill_chunk=16)).validate()
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement), placement)
    return SpeculativeEngine(engine, load_mtp(config, placement))


@pytest.mark.parametrize("draft", ["mirror", "random"])
def test_greedy_equals_plain_greedy(draft):
    spec = _mirror(LayoutConfig()) if draft == "mirror" else _random_draft("tiny-glm5")
    gen = spec.generate(PROMPTS, 24)
    assert gen.tokens == spec.engine.generate(PROMPTS, 24).tokens
    assert gen.acceptance_rate > 0.5 if draft == "mirror" else gen.acceptance_rate < 0.5
    assert gen.steps < 24 if draft == "mirror" else gen.steps == 23


@pytest.mark.parametrize(
    "layout",
    [
        LayoutConfig(placement="ragged_a2a", devices=8, attention="dp"),
        LayoutConfig(placement="weight_prefetch", devices=8, attention="tp"),
        LayoutConfig(placement="hybrid", devices=8, ep=4, tp=2, attention="dp"),
        LayoutConfig(placement="tensor_sliced", devices=8, attention="dp"),
        LayoutConfig(placement="expert_sharded", devices=8, attention="tp"),
    ],
    ids=lambda l: l.placement,
)
def test_greedy_equals_plain_greedy_under_placements(layout):
    spec = _mirror(layout)
    gen = spec.generate(PROMPTS, 16)
    assert gen.tokens == spec.engine.generate(PROMPTS, 16).tokens
    assert gen.acceptance_rate > 0.5


SAMPLED = Sampling(temperature=0.9, top_k=50, top_p=0.9)


def test_sampled_request_amid_seven_others_equals_it_alone():
    """Keys from (seed, position): prompt i of a batch samples as a request of seed S + i alone,
    whatever its neighbours; the first token is the one plain sampling draws."""
    spec = _mirror(LayoutConfig())
    batch = [RNG.randint(0, 512, n).tolist() for n in (7, 30, 12, 19, 3, 25, 9)]
    alone = spec.generate([PROMPTS[0]], 12, SAMPLED, seed=11).tokens[0]
    amid = spec.generate(batch[:3] + [PROMPTS[0]] + batch[3:], 12, SAMPLED, seed=8).tokens[3]
    assert amid == alone and alone[0] == spec.engine.generate([PROMPTS[0]], 1, SAMPLED, seed=11).tokens[0][0]
    assert spec.generate([PROMPTS[0]], 12, SAMPLED, seed=12).tokens[0] != alone  # it did sample


RAGGED_DP = LayoutConfig(placement="ragged_a2a", devices=8, attention="dp")
# Prefill and decode apart: (layout, first device) of each side; the shared pair's two layouts
# of 8 devices are those of the placements test above (their programs compile once).
PD = {
    "split": (
        (dataclasses.replace(RAGGED_DP, devices=4), 0),
        (LayoutConfig(placement="weight_prefetch", devices=4, attention="dp"), 4),
    ),
    "shared": ((RAGGED_DP, 0), (LayoutConfig(placement="weight_prefetch", devices=8, attention="tp"), 0)),
}


@functools.cache
def _apart(pair: str):
    (prefill, first), (decode, decode_first) = PD[pair]
    return Disaggregated(_mirror(prefill, first), _mirror(decode, decode_first)).generate(PROMPTS, 16)


@pytest.mark.parametrize("pair", PD)
def test_prefill_and_decode_apart_give_the_single_placement_tokens_and_drafts(pair):
    alone = _mirror(RAGGED_DP).generate(PROMPTS, 16)
    assert _apart(pair).tokens == alone.tokens == _mirror(RAGGED_DP).engine.generate(PROMPTS, 16).tokens
    # The drafts read the MTP cache handed over: a cache of zeros there would reject most of them.
    assert (_apart(pair).acceptance_rate, _apart(pair).steps) == (alone.acceptance_rate, alone.steps)
    assert alone.acceptance_rate > 0.5


def test_hand_over_between_disjoint_meshes_moves_the_target_and_mtp_caches():
    """4 requests (2, padded for DP on 4 devices), prompts padded to 64 positions, a 64-position
    cache: every byte of both caches changes device."""
    caches = [*init_cache(ONE_LAYER, 4, 64, np.float32), init_mtp_cache(ONE_LAYER, 4, 64, np.float32)]
    assert _apart("split").handover_bytes == sum(a.nbytes for a in jax.tree.leaves(caches))


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=4)])
def test_acceptance_keeps_the_target_distribution(sampling):
    """Speculative sampling's output token is distributed as the target's own samples."""
    n, v = 200_000, 6
    key_p, key_q, key_run = jax.random.split(jax.random.key(0), 3)
    logits = jax.numpy.broadcast_to(2 * jax.random.normal(key_p, (v,)), (n, v))
    q = jax.numpy.broadcast_to(jax.nn.softmax(2 * jax.random.normal(key_q, (v,))), (n, v))
    k_draft, k_verify = jax.random.split(key_run)
    draft = jax.random.categorical(k_draft, jax.numpy.log(q), axis=-1).astype(jax.numpy.int32)
    accepted, token = verify(logits, draft, q, jax.random.split(k_verify, n), sampling)
    p = np.asarray(jax.nn.softmax(sampling_logits(logits[:1], sampling))[0])
    freq = np.bincount(np.asarray(token), minlength=v) / n
    np.testing.assert_allclose(freq, p, atol=0.006)
    assert abs(float(accepted.mean()) - np.minimum(p, np.asarray(q[0])).sum()) < 0.006


def test_sampled_generation_follows_the_target_distribution():
    """End to end on an 8-token vocabulary: the joint law of the first two new tokens (the
    second from a verified draft) against the target's exact one, by a chi-square test."""
    model = dataclasses.replace(ONE_LAYER, vocab_size=8)
    config = Config(model=model, engine=EngineConfig(prefill_chunk=4)).validate()
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement), placement)
    spec = SpeculativeEngine(engine, load_mtp(config, placement))
    prompt, n = [1, 5, 2], 1024
    gen = spec.generate([prompt] * n, 2, Sampling(temperature=1.0), seed=7)
    assert 0.1 < gen.acceptance_rate < 0.9  # both the accept and the resample paths ran
    scores = engine.score([prompt] + [prompt + [t] for t in range(8)])  # one prefill program for both laws
    first = jax.nn.softmax(scores[0][-1])
    second = jax.nn.softmax(np.stack([x[-1] for x in scores[1:]]), axis=-1)
    expected = np.asarray(first, np.float64)[:, None] * np.asarray(second, np.float64)  # [t1, t2]
    expected /= expected.sum()
    observed = np.zeros((8, 8))
    for t1, t2 in gen.tokens:
        observed[t1, t2] += 1
    assert stats.chisquare(observed.ravel(), expected.ravel() * n).pvalue > 1e-3


@pytest.mark.parametrize(
    "where,sampling", [("single", Sampling(temperature=1.0, top_p=0.9)), ("ragged_a2a", Sampling())]
)
def test_jitted_step_has_no_host_transfer(where, sampling):
    spec = (
        _random_draft("tiny-glm5")
        if where == "single"
        else _mirror(LayoutConfig(placement="ragged_a2a", devices=8, attention="dp"))
    )
    e = spec.engine
    cache = e.new_cache(8, 64)
    mtp_cache = e.placement.zeros_cache(lambda: [init_mtp_cache(e.c, 8, 64, e.dtype)])[0]
    state, cache, mtp_cache = spec._prefill(
        e.params,
        spec.mtp,
        cache,
        mtp_cache,
        jax.numpy.ones((8, 16), jax.numpy.int32),
        jax.numpy.full((8,), 3),
        jax.numpy.arange(8),
        sampling=sampling,
    )
    text = spec._step.lower(e.params, spec.mtp, cache, mtp_cache, state, sampling=sampling).compile().as_text()
    assert hlo.launches(text) and hlo.host_transfers(text) == []


def test_host_transfers_catch_a_callback():
    text = jax.jit(lambda x: (jax.debug.callback(print, x), x + 1)[1]).lower(1.0).compile().as_text()
    assert hlo.host_transfers(text)


# ----------------------------------------------------------------------------- loading and CLI


@pytest.fixture(scope="module")
def glm5_dirs(tmp_path_factory):
    """A transformers GLM-5 directory as saved (no MTP), and a copy carrying an MTP layer
    (layer 1's tensors renamed to layer num_layers, plus enorm/hnorm/eh_proj/shared_head)."""
    pytest.importorskip("torch")
    from hf_reference import GLM5, build_hf_model
    from safetensors.numpy import load_file, save_file

    plain = tmp_path_factory.mktemp("glm5_plain")
    build_hf_model(GLM5, plain)
    with_mtp = tmp_path_factory.mktemp("glm5_mtp")
    tensors = {}
    for f in plain.glob("*.safetensors"):
        tensors.update(load_file(f))
    (with_mtp / "config.json").write_text((plain / "config.json").read_text())
    n, d = json.loads((plain / "config.json").read_text())["num_hidden_layers"], 32
    extra = {
        k.replace("model.layers.1.", f"model.layers.{n}."): v
        for k, v in tensors.items()
        if k.startswith("model.layers.1.")
    }
    rng = np.random.RandomState(1)
    extra.update(
        {
            f"model.layers.{n}.enorm.weight": rng.normal(1, 0.1, d).astype(np.float32),
            f"model.layers.{n}.hnorm.weight": rng.normal(1, 0.1, d).astype(np.float32),
            f"model.layers.{n}.eh_proj.weight": rng.normal(0, 0.2, (d, 2 * d)).astype(np.float32),
            f"model.layers.{n}.shared_head.norm.weight": rng.normal(1, 0.1, d).astype(np.float32),
            f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"],
        }
    )
    save_file(tensors, with_mtp / "model.safetensors")
    save_file(extra, with_mtp / "mtp.safetensors")
    return plain, with_mtp, extra, n


def test_mtp_weights_load_from_the_layer_after_the_last(glm5_dirs):
    _, with_mtp, extra, n = glm5_dirs
    from moejax.launch.loading import with_hf_model

    config = with_hf_model(Config(), str(with_mtp)).validate()
    placement = make_placement(config)
    mtp = load_mtp(config, placement, hf_dir=str(with_mtp))
    np.testing.assert_array_equal(mtp["eh_proj"], extra[f"model.layers.{n}.eh_proj.weight"].T)
    np.testing.assert_array_equal(mtp["norm"], extra[f"model.layers.{n}.shared_head.norm.weight"])
    layer1 = layer_params(load_params(config, placement, hf_dir=str(with_mtp)), 1, config.model)
    jax.tree.map(np.testing.assert_array_equal, mtp["layer"], layer1)


def test_checkpoint_without_mtp_is_a_clear_error_unless_random_init(glm5_dirs, capsys):
    plain, _, _, _ = glm5_dirs
    argv = ["generate", "--hf", str(plain), "--speculative", "mtp", "--max-new-tokens", "4", "--json"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no MTP weights" in err and "--mtp-init random" in err
    assert main(argv + ["--mtp-init", "random"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(argv[:3] + argv[5:]) == 0  # the same without --speculative
    assert out["tokens"] == json.loads(capsys.readouterr().out)["tokens"] and 0 <= out["acceptance_rate"] <= 1


@pytest.mark.slow
def test_cli_reads_mtp_from_the_checkpoint(glm5_dirs, capsys):
    _, with_mtp, _, _ = glm5_dirs
    assert (
        main(
            [
                "generate",
                "--hf",
                str(with_mtp),
                "--speculative",
                "mtp",
                "--max-new-tokens",
                "6",
                "--json",
                "--prompt-ids",
                "3,17,45,2",
            ]
        )
        == 0
    )
    assert set(json.loads(capsys.readouterr().out)) == {"tokens", "finish_reasons", "acceptance_rate", "timing"}
