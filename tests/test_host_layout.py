"""The layout of the verbs that run one model when no flag or file chooses one: this host's
(`commands.host_layout`). On a CPU host, one device per core with every weight sliced."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from moejax.cli import build_parser, main
from moejax.config import Config, LayoutConfig, WeightsConfig, preset
from moejax.launch.factory import host_layout
from moejax.launch.flags import config_from_args

ARGV = ["generate", "--preset", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]


def on_cores(monkeypatch, cores: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))


def auto(model: str = "tiny", expert_format: str = "unquantized") -> Config:
    return Config(model=preset(model), layout=LayoutConfig(devices=0), weights=WeightsConfig(expert_format))


def test_a_cpu_host_of_several_cores_runs_one_device_per_core_with_every_weight_sliced(monkeypatch):
    on_cores(monkeypatch, 4)
    layout = host_layout(auto()).layout
    assert (layout.placement, layout.devices, layout.attention, layout.head) == ("tensor_sliced", 4, "tp", "tp")


@pytest.mark.parametrize(
    "model, expert_format, cores, devices",
    [
        ("tiny-qwen3-moe", "unquantized", 3, 2),  # 32 expert columns do not split 3 ways
        ("tiny-qwen3-moe", "nvfp4", 2, 1),  # 16 columns a device would hold half an NVFP4 block pair
        ("tiny", "unquantized", 1, 1),
    ],
)
def test_the_most_devices_that_slice_every_expert_evenly(monkeypatch, model, expert_format, cores, devices):
    on_cores(monkeypatch, cores)
    assert host_layout(auto(model, expert_format)).layout.devices == devices


def test_a_layout_named_by_a_flag_or_a_file_is_kept(tmp_path):
    parse = lambda *flags: config_from_args(build_parser().parse_args([*ARGV, *flags]), host_default=True).layout
    assert parse().devices == 0  # this host's choice, made when the engine is built
    assert parse("--devices", "1") == LayoutConfig(devices=1)
    assert parse("--placement", "ragged_a2a").devices == 1
    file = tmp_path / "run.yaml"
    file.write_text("layout:\n  devices: 2\n")
    assert parse("--config", str(file)).devices == 2
    config = dataclasses.replace(auto(), layout=LayoutConfig(devices=8, placement="hybrid"))
    assert host_layout(config) == config


@pytest.mark.slow
def test_generate_on_this_hosts_layout_gives_the_single_device_tokens(capsys):
    assert main(ARGV) == 0
    ours = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*ARGV, "--devices", "1"]) == 0
    assert ours == json.loads(capsys.readouterr().out)["tokens"]
