"""A kernel is one catalog record: a record added runs wherever the registry and the layer views
read kernels, with no other table to extend; and a record's one question, `why_not`, probes this
jax without touching a deprecated name."""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import catalog, layered, probes

TOY = dataclasses.replace(catalog.gemm("xla"), name="toy")  # XLA's loop under a name of its own


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(catalog.CATALOG, (catalog.GEMM, TOY.name), TOY)
    return TOY.name


def test_a_new_record_runs_in_the_grouped_gemm(toy):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((12, 32)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.float32)
    sizes = jnp.asarray([3, 0, 5, 4], jnp.int32)
    np.testing.assert_array_equal(
        pk.grouped_gemm(lhs, rhs, sizes, backend=toy), pk.grouped_gemm(lhs, rhs, sizes, backend="xla")
    )


def test_a_new_record_that_reads_a_stack_is_handed_a_layer_in_place(toy):
    stack = {"w": jnp.zeros((2, 4, 8, 8)), "b": jnp.zeros((2, 4, 8))}
    view = layered.layer_of(stack, 1, toy, ("w",))
    assert isinstance(view["w"], layered.LayerOf) and view["b"].shape == (4, 8)


def test_a_record_refuses_a_platform_it_is_not_compiled_for_and_names_its_interpreted_twin():
    assert catalog.gemm("triton").why_not("cpu") == (
        "needs an NVIDIA GPU; this machine's backend is cpu (kernel interpret_triton runs it interpreted)"
    )


def test_a_record_refuses_rows_and_experts_it_does_not_multiply():
    assert (
        catalog.gemm("blackwell_bf16")
        .why_not("gpu", dtype="float32", expert_format="nvfp4")
        .startswith("multiplies bfloat16 rows by 4-bit experts")
    )


def test_a_record_refuses_experts_its_module_cannot_tile():
    reason = catalog.gemm("pallas_tpu").why_not("tpu", expert_format="nvfp4", shapes=[(384, 128, False)])
    assert reason.startswith("4-bit experts need a K per device of a multiple of 256")
    assert catalog.gemm("pallas_tpu").why_not("tpu", shapes=[(384, 128, False)]) is None  # unquantized: any K


def test_a_probe_of_a_deprecated_name_neither_warns_nor_misses_it(monkeypatch):
    """jax serves a deprecated name through its module `__getattr__`, which warns (`hasattr` would)."""
    module = types.ModuleType("deprecating")
    module.present = object()
    module._deprecations = {"old": ("old is deprecated", object()), "gone": ("gone was removed", None)}

    def getattr_(name):
        warnings.warn(f"{name} is deprecated", DeprecationWarning, stacklevel=2)
        raise AttributeError(name)

    module.__getattr__ = getattr_
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = probes.missing(module.__name__, ("present", "old", "gone", "absent"))
    assert missing == ["deprecating.gone", "deprecating.absent"]


def test_a_gpu_is_known_by_its_compute_capabilitys_major_version():
    assert probes.gpu_major(types.SimpleNamespace(compute_capability="10.0")) == 10
    assert probes.gpu_major(types.SimpleNamespace()) is None
