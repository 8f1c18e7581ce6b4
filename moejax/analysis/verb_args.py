"""Arguments and output shared by the analysis verbs (`measure_verbs`, `advise_verb`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from checkpoints.hf_config import from_hf_config
from moejax.base.errors import UsageError
from moejax.config import ConfigError, ModelConfig, preset


def device_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UsageError(f"--devices takes positive integers separated by commas, got {text!r}")
    return counts


def positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} must be at least 1, got {value}")
    return value


def model_geometry(args) -> tuple[ModelConfig, str]:
    """The model of --preset or --hf DIR, and a name for it."""
    if getattr(args, "hf", None):
        path = Path(args.hf) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} does not exist")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return from_hf_config(hf), str(args.hf)
    return preset(args.preset), args.preset


def add_geometry_args(parser: argparse.ArgumentParser, default: str | None) -> None:
    """--preset or --hf: the model whose geometry a verb reads (`model_geometry`)."""
    group = parser.add_mutually_exclusive_group(required=default is None)
    group.add_argument("--preset", default=default, help="model preset" + (f" (default {default})" if default else ""))
    group.add_argument("--hf", metavar="DIR", help="Hugging Face model directory (its config.json)")


def emit_json(doc: dict) -> None:
    print(json.dumps(doc, indent=2))
