"""Config files and overrides: YAML/JSON into a `Config`, every key and value checked by name."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moejax.config.errors import ConfigError
from moejax.config.presets import preset
from moejax.config.schema import Config, EngineConfig, LayoutConfig, ModelConfig, WeightsConfig


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks `value` against a dataclass field type; one clear error naming the key otherwise."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return coerce(value, next(a for a in args if a is not type(None)), where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{where} must be a list of integers, got {value!r}")
        return tuple(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return value
    return value


def replace_checked(obj: Any, updates: dict, prefix: str) -> Any:
    """`dataclasses.replace` that rejects unknown keys and wrongly typed values by name."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    clean = {}
    for key, value in updates.items():
        where = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {where!r}")
        clean[key] = coerce(value, hints[key], where)
    return dataclasses.replace(obj, **clean)


def from_dict(data: dict, base: Config | None = None, preset_name: str | None = None) -> Config:
    """Builds a `Config` from a config file's shape: {preset, model, layout, weights, engine, kernel,
    attention_kernel}.

    The model starts from `preset_name` (the CLI's --preset, which wins), else the file's own
    `preset`, else `base`'s; the file's `model:` fields then apply on top of it."""
    if not isinstance(data, dict):
        raise ConfigError("a config file must hold a mapping at the top level")
    cfg = base or Config()
    data = dict(data)
    name = data.pop("preset", None)
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"'preset' must be a string, got {name!r}")
    if preset_name or name:
        cfg = dataclasses.replace(cfg, model=preset(preset_name or name))
    sections = {"model": ModelConfig, "layout": LayoutConfig, "weights": WeightsConfig, "engine": EngineConfig}
    for key, value in data.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"'{key}' must be a mapping, got {value!r}")
            if key == "layout" and "experts" in value:  # the placement key's earlier name
                value = {("placement" if k == "experts" else k): v for k, v in value.items()}
            cfg = dataclasses.replace(cfg, **{key: replace_checked(getattr(cfg, key), value, f"{key}.")})
        elif key in ("kernel", "attention_kernel"):
            cfg = dataclasses.replace(cfg, **{key: coerce(value, str, key)})
        else:
            raise ConfigError(f"unknown config key {key!r}")
    return cfg


def load_file(path: str | Path, base: Config | None = None, preset_name: str | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(
            f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {str(e).splitlines()[0]}"
        ) from None
    return from_dict(data or {}, base, preset_name)
