"""Turn argv and a JSON config file into a validated HeterollmConfig, remembering each value's source.

gflags spellings: `--flag=value`, `--flag value`, booleans as `--flag`, `--flag=true|false` and
`--noflag`; dashes and underscores are the same. Precedence per flag: CLI > JSON file > default.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from heterollm.config.base import FlagGroup
from heterollm.config.errors import ConfigError
from heterollm.config.schema import FOREIGN_FLAGS, ConfigSchema, FlagSpec, HeterollmConfig, build_index, current_schema

Source = Literal["default", "json", "cli"]
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


@dataclass(frozen=True)
class LoadedConfig:
    """The effective config plus where each flag's value came from."""

    config: HeterollmConfig
    sources: dict[str, Source]
    extra: dict[str, Any] = field(default_factory=dict)
    """Values of command-specific flags (e.g. `generate --prompt`), already validated."""

    def describe(self) -> dict[str, dict[str, dict[str, Any]]]:
        """{group: {flag: {"value": v, "source": s}}} for `heterollm config`."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for group_name in type(self.config).model_fields:
            values = getattr(self.config, group_name).model_dump(mode="json")
            out[group_name] = {k: {"value": v, "source": self.sources[k]} for k, v in values.items()}
        return out


class FlagTable:
    """The set of spellings a command accepts: all config flags (the core's and the installed
    backends') plus command-specific groups."""

    def __init__(self, extra_groups: Mapping[str, type[FlagGroup]] | None = None,
                 schema: ConfigSchema | None = None) -> None:
        self.schema = schema or current_schema()
        self.extra_groups = dict(extra_groups or {})
        extra_specs, extra_aliases = build_index(self.extra_groups)
        clash = set(extra_specs) & set(self.schema.specs)
        if clash:
            raise RuntimeError(f"command flags shadow config flags: {sorted(clash)}")
        self.specs: dict[str, FlagSpec] = {**self.schema.specs, **extra_specs}
        self.aliases: dict[str, str] = {**self.schema.aliases, **extra_aliases}

    def canonical(self, spelling: str) -> str | None:
        """The flag name for a spelling (dashes == underscores, aliases resolved), or None."""
        key = spelling.replace("-", "_")
        if key in self.specs:
            return key
        return self.aliases.get(key)

    def unknown(self, spelling: str, where: str) -> ConfigError:
        owner = FOREIGN_FLAGS.get(spelling.replace("-", "_"))
        if owner is not None:
            return ConfigError(f"{where}: belongs to {owner}, which is not installed "
                               f"(pip install {owner}, or drop the flag)")
        names = list(self.specs) + list(self.aliases)
        close = difflib.get_close_matches(spelling.replace("-", "_"), names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
        return ConfigError(f"unknown flag {where}{hint}")


def parse_flags(argv: Sequence[str], table: FlagTable | None = None) -> dict[str, Any]:
    """Parse gflags-style argv into {canonical flag: raw value} (strings, or bools for bare booleans)."""
    table = table or FlagTable()
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: flags are written --name=value or --name value")
        body = token[2:]
        name, has_value, value = body.partition("=")
        flag_name = table.canonical(name)
        if flag_name is None and name.startswith("no") and not has_value:
            negated = table.canonical(name[2:])
            if negated is not None and table.specs[negated].is_bool:
                values[negated] = False
                i += 1
                continue
        if flag_name is None:
            raise table.unknown(name, f"--{name}")
        spec = table.specs[flag_name]
        if has_value:
            values[flag_name] = _bool_word(flag_name, value) if spec.is_bool else value
        elif spec.is_bool:
            nxt = argv[i + 1].lower() if i + 1 < len(argv) else None
            if nxt in ("true", "false"):
                values[flag_name] = _BOOL_WORDS[nxt]
                i += 1
            else:
                values[flag_name] = True
        else:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"--{flag_name}: expects a value (--{flag_name}=VALUE)")
            values[flag_name] = argv[i + 1]
            i += 1
        i += 1
    return values


def _bool_word(flag_name: str, word: str) -> bool:
    try:
        return _BOOL_WORDS[word.lower()]
    except KeyError:
        raise ConfigError(f"--{flag_name}: expects true or false, got {word!r}") from None


def read_json_file(path: str, table: FlagTable) -> dict[str, Any]:
    """Read a flat {flag: value} JSON config file; keys may use any accepted spelling."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config_json_file: cannot read {path!r}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config_json_file: {path!r} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config_json_file: {path!r} must hold a JSON object of flag: value")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = table.canonical(key)
        if name is None or name not in table.schema.specs:
            raise table.unknown(key, f"{key!r} in {path}")
        values[name] = value
    return values


def load_config(argv: Sequence[str] = (), *, table: FlagTable | None = None,
                overrides: Mapping[str, Any] | None = None) -> LoadedConfig:
    """Build the effective config from argv (and `overrides`, treated as CLI values)."""
    table = table or FlagTable()
    cli = parse_flags(argv, table)
    for key, value in (overrides or {}).items():
        name = table.canonical(key)
        if name is None:
            raise table.unknown(key, f"{key!r}")
        cli[name] = value
    json_path = cli.get("config_json_file")
    from_json = read_json_file(json_path, table) if json_path else {}
    from_json.pop("config_json_file", None)
    merged = {**from_json, **cli}
    schema = table.schema
    sources: dict[str, Source] = {
        name: "cli" if name in cli else "json" if name in from_json else "default" for name in schema.specs
    }
    groups = {g: _build_group(g, cls, merged, sources) for g, cls in schema.groups.items()}
    extra = {}
    for g, cls in table.extra_groups.items():
        extra.update(_build_group(g, cls, merged, {k: "cli" for k in merged}).model_dump())
    return LoadedConfig(schema.model(**groups), sources, extra)


def _build_group(group_name: str, cls: type[FlagGroup], values: Mapping[str, Any],
                 sources: Mapping[str, Source]) -> FlagGroup:
    mine = {k: v for k, v in values.items() if k in cls.model_fields}
    try:
        return cls.model_validate(mine)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, mine, sources)) from None


def _explain(exc: ValidationError, values: Mapping[str, Any], sources: Mapping[str, Source]) -> str:
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        msg = err["msg"].removeprefix("Value error, ")
        origin = " (from --config_json_file)" if sources.get(name) == "json" else ""
        got = f", got {values[name]!r}" if name in values and "got" not in msg else ""
        lines.append(f"--{name}: {msg}{got}{origin}")
    return "; ".join(lines)


def dump_config(config: HeterollmConfig, path: str | Path) -> Path:
    """Write the effective config as flat JSON that `--config_json_file` reads back to the same config
    (every flag, `config_json_file` too: reading a file ignores the entry naming a file)."""
    data = config.flat()
    target = Path(path)
    target.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return target
