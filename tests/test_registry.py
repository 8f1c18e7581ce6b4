"""A placement is one class plus one registry line: a new one runs everywhere the others do."""

from __future__ import annotations

import json

import pytest

from moejax.cli import main
from sharding import registry
from sharding.expert_sharded import ExpertSharded


class Toy(ExpertSharded):
    """expert_sharded's exchange under a name of its own."""

    name = "toy"


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, Toy.name, Toy)
    return Toy.name


@pytest.mark.slow
def test_a_registered_placement_runs_in_generate(toy, capsys):
    assert (
        main(
            [
                "generate",
                "--devices",
                "8",
                "--placement",
                toy,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "3",
                "--json",
            ]
        )
        == 0
    )
    toy_tokens = json.loads(capsys.readouterr().out)["tokens"]
    assert main(["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json"]) == 0
    assert toy_tokens == json.loads(capsys.readouterr().out)["tokens"]


@pytest.mark.slow
def test_a_registered_placement_runs_in_compare(toy, capsys):
    assert main(["compare", "--placements", toy, "--max-new-tokens", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["placements"]
    assert report["agree"] and row["name"] == toy and (row["ep"], row["tp"]) == (8, 1)
