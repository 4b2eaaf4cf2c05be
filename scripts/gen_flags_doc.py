"""Regenerate docs/flags.md from the config models: `python scripts/gen_flags_doc.py`.

`--check` exits 1 when the file on disk is stale (the test suite runs this)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_file import write_or_check  # noqa: E402  (scripts/, beside this file)

from heterollm.config.base import flag_aliases, flag_choices
from heterollm.config.cache import KV_EVENTS_REFUSED, KVEventsConfig
from heterollm.config.schema import CORE_GROUPS, current_schema
from heterollm.config.support import RULES
from heterollm.plugins import get_registry

TARGET = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def _type_name(info) -> str:
    choices = flag_choices(info)
    if choices:
        return "string: " + " \\| ".join(choices)
    ann = info.annotation
    name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    return {"str": "string", "int": "int", "float": "float", "bool": "bool"}.get(name, name)


def _default(info) -> str:
    if info.is_required():
        return "(required)"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "(unset)"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _range(info) -> str:
    parts = []
    for meta in info.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(meta, attr, None)
            if v is not None and abs(v) < 2**31 - 1:  # hide the int32/int64 type bounds
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def _statuses() -> dict[str, str]:
    """flag -> where it does not work: the core's table, then each installed backend's refusals."""
    status = {name: rule.reason for name, rule in RULES.items()}
    for info in sorted(get_registry().backends, key=lambda b: b.name):  # stable whatever the install order
        if info.backend is None:
            continue
        for flag, reason in info.backend.unsupported.items():
            prefix = status.get(flag, "")
            status[flag] = f"{prefix}; " if prefix else ""
            status[flag] += f"{info.name}: {reason}"
    return status


def _group_table(group: str, cls, status: dict[str, str]) -> list[str]:
    title = (cls.__doc__ or group).strip().splitlines()[0]
    out = [f"### {group}: {title}", "", "| flag | type | default | range | aliases | status | description |",
           "|---|---|---|---|---|---|---|"]
    for name, info in cls.model_fields.items():
        aliases = ", ".join(f"`--{a}`" for a in flag_aliases(info))
        desc = (info.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `--{name}` | {_type_name(info)} | `{_default(info)}` | {_range(info)} | {aliases} | "
                   f"{status.get(name, '')} | {desc} |")
    return out + [""]


def render() -> str:
    out = ["# heterollm launch flags", "",
           "Generated from `framework/heterollm/config` and the installed backends' descriptors by "
           "`python scripts/gen_flags_doc.py` (with every wheel of this repository installed, as "
           "`scripts/setup.sh` does); do not edit by hand.",
           "", "Spelling: `--flag=value` or `--flag value`; booleans as `--flag`, `--flag=true|false` or "
           "`--noflag`; dashes and underscores are the same. Precedence per flag: command line > "
           "`--config_json_file` > default. Descriptions of xLLM flags are the spec's own (xLLM documents "
           "them in Chinese).", "",
           "**Status** says where a flag does not work. Empty: it works wherever its section says. Otherwise "
           "a non-default value fails at launch with the reason shown: the core's (a feature a later issue "
           "builds, DiT or multimodal models), or a backend's (`name: reason`, when that backend is selected).",
           "", "## Core flags", "",
           "Every installation has these.", ""]
    status = _statuses()
    for group, cls in CORE_GROUPS.items():
        out += _group_table(group, cls, status)
    schema = current_schema()
    by_owner: dict[str, list[str]] = {}
    for group in schema.groups:
        if group not in CORE_GROUPS:
            spec = next(iter(schema.specs[n] for n in schema.groups[group].model_fields))
            by_owner.setdefault(spec.owner, []).append(group)
    for owner, groups in sorted(by_owner.items()):
        backend = schema.specs[next(iter(schema.groups[groups[0]].model_fields))].backend
        out += [f"## Backend {backend} ({owner})", "",
                f"Present when `{owner}` is installed, and usable only when a launch selects that backend "
                f"(`--device {backend}`, or `--extension_impl {backend}` where it provides a component); "
                f"otherwise a non-default value is refused naming `{owner}`. Without the wheel, setting one "
                f"fails with \"belongs to {owner}, which is not installed\".", ""]
        for group in groups:
            out += _group_table(group, schema.groups[group], status)
    return "\n".join(out + _kv_events_fields())


def _kv_events_fields() -> list[str]:
    out = ["## --kv_events_config: the JSON object", "",
           "`--kv_events_config` holds a JSON object with these fields (example: "
           "`{\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}`). "
           "DP rank r uses each endpoint's port + r; overlapping port ranges fail at launch. Wire format: "
           "README.md, *KV cache events*.", "",
           "| field | type | default | range | status | description |", "|---|---|---|---|---|---|"]
    for name, info in KVEventsConfig.model_fields.items():
        status = f"must stay empty: {KV_EVENTS_REFUSED[name]}" if name in KV_EVENTS_REFUSED else ""
        desc = (info.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{name}` | {_type_name(info)} | `{_default(info)}` | {_range(info)} | {status} | {desc} |")
    return out + [""]


def main(argv: list[str]) -> int:
    return write_or_check(TARGET, render(), argv, "python scripts/gen_flags_doc.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
