"""Launch configuration: one pydantic model per flag group (the core's plus the installed backends');
CLI > JSON file > defaults."""
from typing import Any

from heterollm.config.errors import ConfigError
from heterollm.config.loader import LoadedConfig, dump_config, load_config, parse_flags
from heterollm.config.schema import ConfigSchema, HeterollmConfig, current_schema

__all__ = ["ConfigError", "ConfigSchema", "FLAG_SPECS", "HeterollmConfig", "LoadedConfig", "current_schema",
           "dump_config", "load_config", "parse_flags"]


def __getattr__(name: str) -> Any:
    """`FLAG_SPECS`: every flag of the installed backends' schema, by name (read lazily: the
    backends' groups are discovered on first use)."""
    if name == "FLAG_SPECS":
        return current_schema().specs
    raise AttributeError(name)
