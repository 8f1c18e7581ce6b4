"""The model against transformers (the independent reference), and the engine against itself."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import FAMILIES, build_hf_model, hf_greedy, hf_logits

from moejax.compiled import hlo
from moejax.config import Config, EngineConfig
from moejax.engine.buckets import decode_visible
from moejax.engine.engine import Engine
from moejax.engine.sampling import Sampling
from moejax.engine.steps import decode_steps
from moejax.launch.loading import load_params, with_hf_model
from sharding import make_placement

PROMPT = [3, 17, 45, 2, 88, 61, 9, 30, 12]
GOLDEN = Path(__file__).parent / "golden"


@functools.cache
def _engine(hf_dir: str, engine: tuple) -> Engine:
    config = with_hf_model(Config(engine=EngineConfig(**dict(engine))), hf_dir).validate()
    placement = make_placement(config)
    return Engine(config, load_params(config, placement, hf_dir=hf_dir), placement)


def make_engine(hf_dir, **engine) -> Engine:
    """Engines are shared between tests: compiling is most of a test's time on CPU."""
    return _engine(str(hf_dir), tuple(sorted(engine.items())))


def assert_close_relative(ours, ref, rel=1e-4):
    np.testing.assert_allclose(ours, ref, rtol=0, atol=rel * np.abs(ref).max())


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request, tmp_path_factory):
    pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp(request.param)
    return build_hf_model(request.param, directory), directory


def test_prefill_logits_match_transformers(hf):
    model, directory = hf
    assert_close_relative(make_engine(directory).score([PROMPT])[0], hf_logits(model, PROMPT))


def test_greedy_tokens_match_transformers(hf):
    model, directory = hf
    assert make_engine(directory).generate([PROMPT], 16).tokens[0] == hf_greedy(model, PROMPT, 16)


def test_layer_scan_gives_the_unrolled_layers_logits(hf):
    """Accelerators scan each run of layers; XLA:CPU unrolls them over per-layer arrays."""
    _, directory = hf
    scan, unrolled = (make_engine(directory, layer_loop=loop) for loop in ("scan", "unroll"))
    assert isinstance(unrolled.params["layers"][0], tuple) and not isinstance(scan.params["layers"][0], tuple)
    assert_close_relative(scan.score([PROMPT])[0], unrolled.score([PROMPT])[0], rel=1e-6)
    assert scan.generate([PROMPT], 8).tokens == unrolled.generate([PROMPT], 8).tokens


def test_cached_decode_logits_equal_full_forward(hf):
    _, directory = hf
    engine = make_engine(directory)
    gen = engine.generate([PROMPT], 6, return_logits=True)
    full = engine.score([PROMPT + gen.tokens[0][:-1]])[0]
    assert_close_relative(gen.logits[:, 0], full[len(PROMPT) - 1 :], rel=1e-5)


def test_chunked_prefill_equals_one_shot(hf):
    _, directory = hf
    one_shot = make_engine(directory, prefill_chunk=64).score([PROMPT])[0]
    chunked = make_engine(directory, prefill_chunk=4).score([PROMPT])[0]
    assert_close_relative(chunked, one_shot, rel=1e-5)


def test_long_prompt_in_blocks_of_queries_matches_transformers(hf):
    """A 300-token prompt in chunks of 256: each chunk's queries attend a block of 128 at a time
    over blocks of 128 keys up to the block's last position; the second chunk's from 256 on."""
    model, directory = hf
    prompt = (PROMPT * 34)[:300]
    assert_close_relative(make_engine(directory, prefill_chunk=256).score([prompt])[0], hf_logits(model, prompt))


def test_bfloat16_logits_close_to_float32(hf):
    _, directory = hf
    f32 = make_engine(directory).score([PROMPT])[0]
    bf16 = make_engine(directory, dtype="bfloat16").score([PROMPT])[0]
    # bfloat16 keeps ~3 significant digits; a router pick may flip at a near tie, so the
    # check is on the mean error and the argmax, not on every logit.
    assert np.abs(bf16 - f32).mean() < 0.02 * np.abs(f32).max()
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_goldens_without_torch(family):
    """Golden outputs made once by tests/make_goldens.py from transformers, for runs without torch."""
    directory = GOLDEN / family
    expected = np.load(directory / "expected.npz")
    engine = make_engine(directory)
    assert_close_relative(engine.score([expected["prompt"].tolist()])[0], expected["logits"])
    assert engine.generate([expected["prompt"].tolist()], 16).tokens[0] == expected["greedy"].tolist()


# ----------------------------------------------------------------------------- engine behaviour


@pytest.fixture(scope="module")
def tiny_engine():
    return make_engine(GOLDEN / "deepseek_v3", prefill_chunk=4)


def test_batch_of_different_lengths_equals_single_requests(tiny_engine):
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:] * 2]
    batch = tiny_engine.generate(prompts, 8).tokens
    assert batch == [tiny_engine.generate([p], 8).tokens[0] for p in prompts]


def test_same_inputs_give_same_tokens(tiny_engine):
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9)
    a = tiny_engine.generate([PROMPT], 8, sampling, seed=3).tokens
    assert a == tiny_engine.generate([PROMPT], 8, sampling, seed=3).tokens


def test_different_seeds_sample_differently(tiny_engine):
    sampling = Sampling(temperature=2.0)
    runs = {tuple(tiny_engine.generate([PROMPT], 8, sampling, seed=s).tokens[0]) for s in range(4)}
    assert len(runs) > 1


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0, top_k=1), Sampling(temperature=1.0, top_p=1e-6)])
def test_top_k_one_and_tiny_top_p_are_greedy(tiny_engine, sampling):
    greedy = tiny_engine.generate([PROMPT], 8).tokens
    assert tiny_engine.generate([PROMPT], 8, sampling, seed=1).tokens == greedy


def test_top_k_samples_only_among_the_k_best(tiny_engine):
    gen = tiny_engine.generate([PROMPT], 8, Sampling(temperature=5.0, top_k=3), seed=0, return_logits=True)
    for step, token in enumerate(gen.tokens[0]):
        assert token in np.argsort(gen.logits[step, 0])[-3:]


def test_decode_compiles_with_its_platforms_options(tiny_engine):
    """On XLA:CPU a decode step's small dots run through XLA's own dot emitter: the engine's decode
    block holds no YNN fusion, where the same function under XLA's defaults holds several."""
    state = tiny_engine.start([PROMPT], 9)
    args = (tiny_engine.params, state.cache, state.tok, jnp.asarray(state.lens), state.seeds, 1, 8, state.pages)
    defaults = jax.jit(
        functools.partial(decode_steps, c=tiny_engine.c, placement=tiny_engine.placement),
        static_argnames=("block", "sampling"),
    )

    def ynn_fusions(f) -> float:
        launches = hlo.launches(f.lower(*args, block=8, sampling=Sampling()).compile().as_text())
        assert launches
        return hlo.by_kind(launches).get("fusion __ynn_fusion", 0)

    assert ynn_fusions(tiny_engine._decode_block) == 0 < ynn_fusions(defaults)


def test_decode_visible_rounds_up_to_an_eighth_of_the_next_power_of_two():
    assert [decode_visible(n) for n in (1, 128, 129, 545, 1000, 5000)] == [128, 128, 256, 640, 1024, 5120]


def test_decode_blocks_read_the_positions_the_generation_reaches_and_decode_as_steps_over_the_whole_cache():
    """A 280-token prompt's cache holds 512 positions; its decode blocks attend to the first 384
    (`decode_visible` of its last position), and give the tokens of single steps that read all 512."""
    engine = make_engine(GOLDEN / "deepseek_v3")
    prompt = (PROMPT * 40)[:280]
    state = engine.start([prompt], 9)
    assert jax.tree.leaves(state.cache)[0].shape[-2] == 512 and decode_visible(280 + 8) == 384
    blocks = engine.decode(state, 9).tokens
    engine.decode_block = 1
    try:
        assert engine.generate([prompt], 9).tokens == blocks
    finally:
        engine.decode_block = EngineConfig().decode_block


def test_a_generate_decodes_with_one_block_program_as_its_rows_grow(monkeypatch):
    """Rows growing past a multiple of the visible step mid-generate (positions 245 .. 264 cross
    256) keep the program of the first block, which reads what the last step reaches (384 of the
    cache's 512 positions), rather than compile or load another one (a CLI generate runs each of
    its programs once)."""
    engine = make_engine(GOLDEN / "deepseek_v3")
    block, visible = engine._decode_block, []

    def recording(*args, **kwargs):
        visible.append(kwargs["visible"])
        return block(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode_block", recording)
    engine.generate([(PROMPT * 40)[:245]], 20)
    assert visible == [decode_visible(245 + 20 - 1)] * 3 == [384] * 3


def compiled(engine) -> tuple[int, ...]:
    """Programs compiled so far by each of the engine's jitted steps: prefill, one decode step
    and a block of decode steps (what `generate` decodes with)."""
    return tuple(f._cache_size() for f in (engine._prefill, engine._decode, engine._decode_block))


def test_new_prompt_mix_in_the_same_bucket_does_not_recompile(tiny_engine):
    tiny_engine.generate([PROMPT, PROMPT[:4]], 4)
    sizes = compiled(tiny_engine)
    assert sizes[0] and sizes[2]  # the check sees the programs this generate ran
    tiny_engine.generate([PROMPT[:5], PROMPT[1:]], 4)
    assert compiled(tiny_engine) == sizes


def test_full_cache_ends_the_request_by_length():
    engine = make_engine(GOLDEN / "deepseek_v3", prefill_chunk=4, max_seq_len=12)
    gen = engine.generate([PROMPT, PROMPT[:2]], 8)
    assert len(gen.tokens[0]) == 12 - len(PROMPT) + 1 and len(gen.tokens[1]) == 8
    assert gen.finish_reasons == ["length", "length"]
