"""Building blocks for flag groups: the `flag()` field helper and sized integer types."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1

Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


class FlagGroup(BaseModel):
    """One group of launch flags. Every field is a flag: a type, a default, a description."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, strict=False)


def flag(default: Any, description: str, *, aliases: tuple[str, ...] = (), **constraints: Any) -> Any:
    """Declare a flag field.

    `aliases` are other spellings accepted on the CLI and in JSON (FastDeploy's names for the
    same idea). `constraints` are pydantic Field constraints (gt, ge, le, lt, pattern ...).
    """
    extra = {"aliases": list(aliases)} if aliases else None
    return Field(default, description=description, json_schema_extra=extra, **constraints)


def flag_aliases(field_info: Any) -> list[str]:
    """The alias spellings declared for a field through `flag(aliases=...)`."""
    extra = field_info.json_schema_extra or {}
    return list(extra.get("aliases", [])) if isinstance(extra, dict) else []


def choice(*allowed: str) -> Any:
    """A string flag restricted to `allowed` values (error names them all)."""

    def check(value: str) -> str:
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise ValueError(f"must be one of {shown}, got {value!r}")
        return value

    check.allowed = allowed  # type: ignore[attr-defined]  # read back by flag_choices()
    return Annotated[str, AfterValidator(check)]


def flag_choices(field_info: Any) -> tuple[str, ...] | None:
    """The allowed values of a `choice()` flag, or None for an open flag."""
    for meta in getattr(field_info, "metadata", ()):
        allowed = getattr(getattr(meta, "func", None), "allowed", None)
        if allowed is not None:
            return tuple(allowed)
    return None
