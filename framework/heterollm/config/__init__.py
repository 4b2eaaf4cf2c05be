"""Launch configuration: one pydantic model per flag group; CLI > JSON file > defaults."""
from heterollm.config.errors import ConfigError
from heterollm.config.loader import LoadedConfig, dump_config, load_config, parse_flags
from heterollm.config.schema import FLAG_SPECS, HeterollmConfig

__all__ = ["ConfigError", "FLAG_SPECS", "HeterollmConfig", "LoadedConfig", "dump_config", "load_config", "parse_flags"]
