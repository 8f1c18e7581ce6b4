"""Configuration: the schema (`schema`), the rotary embedding read from its many spellings
(`rope`), named models (`presets`) and config files with overrides (`files`). Reading a
transformers `config.json` lives beside the other transformers code, in `checkpoints.hf_config`.
"""

from moejax.config.errors import ConfigError
from moejax.config.files import from_dict, load_file, replace_checked
from moejax.config.presets import PRESETS, preset
from moejax.config.rope import Rope, read_rope
from moejax.config.schema import (
    OLD_EXPERT_FORMAT_NAMES,
    Config,
    EngineConfig,
    LayoutConfig,
    ModelConfig,
    WeightsConfig,
    current_name,
)

__all__ = [
    "OLD_EXPERT_FORMAT_NAMES",
    "PRESETS",
    "Config",
    "ConfigError",
    "EngineConfig",
    "LayoutConfig",
    "ModelConfig",
    "Rope",
    "WeightsConfig",
    "from_dict",
    "load_file",
    "preset",
    "current_name",
    "read_rope",
    "replace_checked",
]
