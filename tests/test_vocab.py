"""One list per vocabulary: the CLI's choices, config validation and the registries that
implement the names read the same tuple; each placement name lives in one module."""

from __future__ import annotations

import re
import types
from pathlib import Path

import numpy as np
import pytest

from moejax import vocab
from moejax.base import platform
from moejax.cli import build_parser
from moejax.config import Config, ConfigError, EngineConfig, LayoutConfig, WeightsConfig, load_file
from moejax.launch.flags import config_from_args
from pallas_kernels import catalog, paged_attention, run_weights
from pallas_kernels import registry as kernel_registry
from pallas_kernels.gmm_blackwell import BlackwellWeights
from sharding import names

ROOT = Path(__file__).parent.parent
SOURCES = [p for d in ("moejax", "sharding", "pallas_kernels", "checkpoints") for p in (ROOT / d).rglob("*.py")]


def choices(verb: str, flag: str) -> tuple:
    sub = next(a for a in build_parser()._actions if a.dest == "verb").choices[verb]
    return tuple(next(a for a in sub._actions if flag in a.option_strings).choices)


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("--placement", names()),
        ("--kernel", vocab.KERNELS),
        ("--expert-format", vocab.EXPERT_FORMATS),
        ("--dtype", vocab.RUN_DTYPES),
        ("--attention", vocab.ATTENTION_MODES),
        ("--dispatch-dtype", vocab.DISPATCH_DTYPES),
        ("--head", vocab.SPLIT_MODES),
        ("--attention-kernel", vocab.ATTENTION_KERNELS),
    ],
)
def test_cli_choices_are_the_vocabulary(flag, expected):
    assert choices("generate", flag) == tuple(expected)


@pytest.mark.parametrize("name", vocab.KERNELS)
def test_every_kernel_name_is_a_backend_function_on_every_platform(name):
    """Each --kernel word ("auto" on each platform and GPU architecture it knows) names functions of pallas_kernels."""
    gpus = [types.SimpleNamespace(compute_capability=f"{major}.0") for major in platform.AUTO_GPU_KERNELS]
    for target in platform.PLATFORMS:
        for device in [None, *gpus]:
            backends = platform.resolve(target).gemm_candidates(name, device)
            assert "auto" not in backends and all(callable(kernel_registry.backend_fn(b)) for b in backends)


@pytest.mark.parametrize(
    "section,key,values",
    [
        ("engine", "dtype", vocab.RUN_DTYPES),
        ("weights", "expert_format", vocab.EXPERT_FORMATS),
        ("layout", "attention", vocab.ATTENTION_MODES),
        ("layout", "dense", vocab.SPLIT_MODES),
        ("layout", "shared_expert", vocab.SPLIT_MODES),
        ("layout", "dispatch_dtype", vocab.DISPATCH_DTYPES),
        ("layout", "head", vocab.SPLIT_MODES),
        ("engine", "layer_loop", vocab.LAYER_LOOPS),
    ],
)
def test_config_accepts_each_word_of_its_vocabulary_and_nothing_else(section, key, values):
    make = {
        "engine": lambda v: Config(engine=EngineConfig(**{key: v})),
        "weights": lambda v: Config(weights=WeightsConfig(**{key: v})),
        "layout": lambda v: Config(layout=LayoutConfig(**{key: v})),
    }[section]
    for value in values:
        make(value).validate()
    with pytest.raises(ConfigError, match=key):
        make("nope").validate()


@pytest.mark.parametrize("name", vocab.ATTENTION_KERNELS)
def test_every_attention_kernel_name_is_the_xla_path_or_a_kernel_on_every_platform(name):
    for target in platform.PLATFORMS:
        assert platform.resolve(target).attention_kernel(name) in ("xla", *paged_attention.KERNELS)
    Config(attention_kernel=name).validate()


def test_the_kernel_words_are_the_catalogs_names():
    """vocab imports nothing, so its closed words are checked here against the catalog's records
    ("auto" resolves to one of them; the attention's "xla" is the gather of `moejax.model.paged`)."""
    assert vocab.KERNELS == ("auto", *catalog.names(catalog.GEMM))
    assert vocab.ATTENTION_KERNELS == ("auto", "xla", *catalog.names(catalog.ATTENTION))


def test_a_kernel_name_means_one_backend_wherever_it_is_used():
    backends = {}
    for kernel in catalog.CATALOG.values():
        backends.setdefault(kernel.name, set()).add(kernel.backend)
    assert {name: b for name, b in backends.items() if len(b) > 1} == {}


@pytest.mark.parametrize("key", list(catalog.CATALOG), ids="-".join)
def test_every_catalog_record_names_a_function_of_its_module(key):
    assert callable(catalog.CATALOG[key].load())


@pytest.mark.parametrize(
    "field, old, new",
    [(field, old, new) for field, renamed in vocab.ALIASES.items() for old, new in renamed.items()],
)
def test_an_earlier_kernel_name_is_read_as_its_current_one_with_a_note(field, old, new, tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text(f"{field}: {old}\n")
    flag = "--" + field.replace("_", "-")
    from_flag = config_from_args(build_parser().parse_args(["generate", flag, old]))
    assert getattr(load_file(path), field) == getattr(from_flag, field) == new
    assert f"note: {field} {old!r} is now called {new!r}" in capsys.readouterr().err


def test_kernel_config_accepts_every_kernel_name():
    for name in vocab.KERNELS:
        Config(kernel=name).validate()
    with pytest.raises(ConfigError, match="kernel 'nope'"):
        Config(kernel="nope").validate()


@pytest.mark.parametrize("name", names())
def test_each_placement_name_string_is_in_exactly_one_module(name):
    holders = [p for p in SOURCES if re.search(rf"[\"']{name}[\"']", p.read_text())]
    assert len(holders) == 1, holders


def test_config_file_model_fields_apply_on_top_of_the_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  num_layers: 2\nlayout:\n  placement: ragged_a2a\n")
    args = build_parser().parse_args(["generate", "--preset", "tiny-qwen3-moe", "--config", str(path)])
    config = config_from_args(args)
    assert (config.model.family, config.model.num_layers) == ("qwen3_moe", 2)
    assert config.layout.placement == "ragged_a2a"


def test_config_files_in_the_earlier_words_still_read(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("layout:\n  experts: hybrid\nweights:\n  expert_format: bf16\n")
    config = load_file(path)
    assert (config.layout.placement, config.weights.expert_format) == ("hybrid", "unquantized")


def test_blackwell_weights_are_prepared_once_at_load():
    """The kernel's K-major layout and scale tiling are made from the 4-bit experts when
    they are loaded, so no call converts them."""
    w = np.random.default_rng(0).normal(size=(2, 256, 128)).astype(np.float32)
    prepared = run_weights(w, "nvfp4", kernel="blackwell")
    assert isinstance(prepared, BlackwellWeights) and prepared.shape == w.shape
    assert not isinstance(run_weights(w, "nvfp4"), BlackwellWeights)
