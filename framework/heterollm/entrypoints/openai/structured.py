"""The request fields that ask for structured output, in every spelling clients use: OpenAI's
`response_format` (`json_object`, `json_schema` with `strict`; vLLM's `structural_tag`), vLLM's
`structured_outputs` object, and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` (with `guided_decoding_backend`, `guided_whitespace_pattern`). Each becomes one
StructuredOutputsParams; a malformed one is a 400 naming the field it came from."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from heterollm.sampling import StructuredOutputError, StructuredOutputsParams

BACKENDS = ("auto", "xgrammar")
"""The backends a request's `guided_decoding_backend` may name (the server compiles with xgrammar)."""

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
                    "disable_fallback", "disable_additional_properties", "whitespace_pattern")
"""vLLM's StructuredOutputsParams fields."""


class StructuredRequestError(ValueError):
    """Rendered as a 400 naming `field`."""

    def __init__(self, message: str, field_name: str) -> None:
        super().__init__(message)
        self.field = field_name


class StructuredFields(BaseModel):
    """Mixed into the completion and chat request models."""

    model_config = ConfigDict(strict=True, extra="allow")

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The request's one constraint, or None; StructuredRequestError names the field at fault."""
        self._check_options()
        given = [(name, build) for name, build in (
            ("response_format", self._from_response_format), ("structured_outputs", self._from_structured_outputs),
            ("guided_json", lambda: {"json": self.guided_json}), ("guided_regex", lambda: {"regex": self.guided_regex}),
            ("guided_choice", lambda: {"choice": self.guided_choice}),
            ("guided_grammar", lambda: {"grammar": self.guided_grammar})) if getattr(self, name) is not None]
        specs = [(name, kwargs) for name, build in given if (kwargs := build()) is not None]
        if not specs:
            return None
        if len(specs) > 1:
            raise StructuredRequestError(f"{specs[1][0]}: only one structured output constraint per request "
                                         f"({specs[0][0]} is given too)", specs[1][0])
        name, kwargs = specs[0]
        try:
            return StructuredOutputsParams(**kwargs, origin=name)
        except StructuredOutputError as exc:
            raise StructuredRequestError(str(exc), exc.field) from None

    def _check_options(self) -> None:
        backend = self.guided_decoding_backend
        if backend is not None and backend not in BACKENDS:
            raise StructuredRequestError(f"guided_decoding_backend: {backend!r} is not available; this server "
                                         f"compiles grammars with xgrammar ({' or '.join(map(repr, BACKENDS))})",
                                         "guided_decoding_backend")
        if self.guided_whitespace_pattern is not None:
            raise StructuredRequestError("guided_whitespace_pattern is not supported: xgrammar takes no whitespace "
                                         "pattern (use structured_outputs.disable_any_whitespace for compact JSON)",
                                         "guided_whitespace_pattern")

    def _from_response_format(self) -> dict[str, Any] | None:
        rf = self.response_format
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise StructuredRequestError("response_format.json_schema must be an object with a `schema` object",
                                             "response_format.json_schema")
            if "strict" in js and not isinstance(js["strict"], bool) and js["strict"] is not None:
                raise StructuredRequestError("response_format.json_schema.strict must be a boolean",
                                             "response_format.json_schema.strict")
            # strict or not, the output follows the schema: the grammar allows nothing else
            return {"json": js.get("schema", {})}
        if kind == "structural_tag":
            # vLLM's older form {structures, triggers}, or xgrammar's {"type": "structural_tag", "format": ...}
            return {"structural_tag": {k: v for k, v in rf.items() if k != "type"} if "structures" in rf else rf}
        raise StructuredRequestError(f"response_format.type must be one of text, json_object, json_schema, "
                                     f"structural_tag; got {kind!r}", "response_format.type")

    def _from_structured_outputs(self) -> dict[str, Any]:
        so = dict(self.structured_outputs)
        unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
        if unknown:
            raise StructuredRequestError(f"structured_outputs.{unknown[0]} is not a field of structured_outputs "
                                         f"(fields: {', '.join(_STRUCTURED_KEYS)})", f"structured_outputs.{unknown[0]}")
        if so.pop("whitespace_pattern", None) is not None:
            raise StructuredRequestError("structured_outputs.whitespace_pattern is not supported: xgrammar takes no "
                                         "whitespace pattern (use disable_any_whitespace)",
                                         "structured_outputs.whitespace_pattern")
        if so.pop("disable_additional_properties", False):
            raise StructuredRequestError("structured_outputs.disable_additional_properties is not supported: give "
                                         "the schema \"additionalProperties\": false where it applies",
                                         "structured_outputs.disable_additional_properties")
        so.pop("disable_fallback", None)  # there is one backend: it never falls back
        return so
