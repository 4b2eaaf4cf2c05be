"""Structured output on xgrammar: what a request asks for (StructuredOutputsParams: a JSON schema,
any JSON object, a regex, a choice, an EBNF/GBNF grammar or a structural tag), grammars compiled
off the step loop with a cache keyed by the grammar (StructuredOutputManager), one matcher per
sequence (GrammarState), and the batch's token bitmask that the sampler applies.

The engine owns the manager and the states; a step carries only the packed bitmask (one int32
word per 32 tokens and row) to the workers, which unpack and apply it with torch ops
(sampler.apply_token_bitmask) on whatever device the logits are, so no backend needs xgrammar.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("heterollm.structured")

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraints a request may ask for, exactly one at a time (vLLM's StructuredOutputsParams)."""


MAX_WHITESPACE = 24
"""Most whitespace characters allowed between two JSON tokens (unbounded, a small model can fill
max_tokens with newlines and never close the object)."""


class StructuredOutputError(ValueError):
    """A constraint that is malformed or does not compile; `field` names the request field
    (HTTP 400 / CLI exit 2)."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        self.reason = message
        super().__init__(f"{field_name}: {message}")

    def named(self, field_name: str) -> StructuredOutputError:
        """The same reason, naming `field_name` (a cached compile may have failed for a request that
        spelled the constraint through another field)."""
        return StructuredOutputError(field_name, self.reason)


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's `structured_outputs`, OpenAI's
    `response_format`, vLLM's older `guided_*` fields all become one of these).

    `origin` is the request field it came from, named in every error about it."""

    json: str | dict | None = None
    """A JSON schema (a dict or its JSON text): the output is one JSON value valid against it."""
    regex: str | None = None
    """The output fully matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF / GBNF grammar (`root ::= ...`): the output is a sentence of it."""
    json_object: bool | None = None
    """True: the output is some JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    structural_tag: str | dict | None = None
    """xgrammar's structural tag (JSON): free text in which each trigger starts a constrained part."""
    disable_any_whitespace: bool = False
    """JSON without the optional whitespace between tokens (as --guided_decoding_disable_any_whitespace)."""
    origin: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            what = "none is given" if not given else f"{', '.join(given)} are given"
            raise StructuredOutputError(self.origin, f"give exactly one of {', '.join(KINDS)}; {what}")
        kind = given[0]
        value = getattr(self, kind)
        name = self.field_name
        if kind == "json":
            if isinstance(value, str):
                try:
                    self.json = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise StructuredOutputError(name, f"the schema is not valid JSON: {exc}") from None
            if not isinstance(self.json, (dict, bool)):
                raise StructuredOutputError(name, "a JSON schema must be an object")
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise StructuredOutputError(name, "must be a non-empty list of non-empty strings")
        elif kind == "json_object":
            if value is not True:
                raise StructuredOutputError(name, "must be true when given")
        elif kind == "structural_tag":
            self.structural_tag = _structural_tag_dict(value, name)
        elif not isinstance(value, str) or not value:
            raise StructuredOutputError(name, "must be a non-empty string")
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputError(f"{self.origin}.disable_any_whitespace", "must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def field_name(self) -> str:
        """The request field errors name: `structured_outputs.regex`, or the origin itself when it
        is one field (`guided_regex`, `response_format`)."""
        kind = next((k for k in KINDS if getattr(self, k) is not None), None)
        return f"{self.origin}.{kind}" if self.origin == "structured_outputs" and kind else self.origin

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: the cache key."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace


def _structural_tag_dict(value: Any, name: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(name, f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise StructuredOutputError(name, "must be a JSON object")
    return value


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly the choices (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def bounded_strings_as_patterns(schema: Any) -> Any:
    """The schema with each string's minLength / maxLength (without a pattern) spelled as the pattern
    `^.{min,max}$`: xgrammar 0.2 compiles length-bounded strings to a character class that lets raw
    control characters in, which is not JSON (mlc-ai/xgrammar#800); its pattern path escapes them.
    Data keywords (enum, const, default, examples) are left as they are."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bounded_strings_as_patterns(v) for k, v in schema.items()}
    if out.get("type") == "string" and "pattern" not in out and ("minLength" in out or "maxLength" in out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def compiler_reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarState:
    """One sequence's progress through its grammar. Built when the request is admitted; its matcher
    exists once the grammar has compiled (the scheduler holds the request back until then)."""

    def __init__(self, future: Future, spec: StructuredOutputsParams) -> None:
        self.future = future
        self.spec = spec
        self._matcher: Any = None

    @property
    def ready(self) -> bool:
        """Compiled: the sequence can be scheduled (a grammar that failed to compile never is)."""
        return self.future.done() and self.future.exception() is None

    @property
    def error(self) -> StructuredOutputError | None:
        if not self.future.done():
            return None
        exc = self.future.exception()
        if exc is None:
            return None
        return exc.named(self.spec.field_name) if isinstance(exc, StructuredOutputError) else \
            StructuredOutputError(self.spec.field_name, compiler_reason(exc))

    def result(self) -> Any:
        """The compiled grammar (waits for it); StructuredOutputError naming this request's field."""
        try:
            return self.future.result()
        except StructuredOutputError as exc:
            raise exc.named(self.spec.field_name) from None

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self.future.result())
        return self._matcher

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it (or has ended)."""
        return not self.matcher.is_terminated() and self.matcher.accept_token(token)


class StructuredOutputManager:
    """Compiles constraints for one engine's tokenizer on a background thread, caches the compiled
    grammars (LRU, keyed by StructuredOutputsParams.key), and fills a step's bitmask."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 disable_any_whitespace: bool = False, cache_size: int = 256) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.default_disable_any_whitespace = disable_any_whitespace
        """--guided_decoding_disable_any_whitespace: the default for every JSON constraint."""
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="heterollm-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compile_seconds: dict[tuple, float] = {}
        """Wall time each cached grammar took to compile (bench/structured.py reports it)."""
        self._batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar for `spec`, as a future: cached, or compiling on the background
        thread. A future that failed holds a StructuredOutputError naming the request field."""
        if self.default_disable_any_whitespace and not spec.disable_any_whitespace:
            spec.disable_any_whitespace = True
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec, key)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                old, _ = self._cache.popitem(last=False)
                self.compile_seconds.pop(old, None)
            return future

    def _compile(self, spec: StructuredOutputsParams, key: tuple) -> Any:
        started = time.perf_counter()
        try:
            compiled = self._build(spec)
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError (and subclasses) with the reason
            raise StructuredOutputError(spec.field_name, compiler_reason(exc)) from None
        self.compile_seconds[key] = time.perf_counter() - started
        logger.debug("compiled a %s constraint in %.1f ms", spec.kind, self.compile_seconds[key] * 1000)
        return compiled

    def _build(self, spec: StructuredOutputsParams) -> Any:
        c, ws = self.compiler, self._whitespace(spec)
        kind = spec.kind
        if kind == "json":
            return c.compile_json_schema(json.dumps(bounded_strings_as_patterns(spec.json)), **ws)
        if kind == "json_object":
            return c.compile_json_schema(json.dumps({"type": "object"}), **ws)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(spec.choice))
        if kind == "grammar":
            return c.compile_grammar(spec.grammar)
        tag = spec.structural_tag
        if "structures" in tag:  # the older form: {"structures": [{begin, schema, end}], "triggers": [...]}
            items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return c.compile_structural_tag(items, tag.get("triggers", []))
        return c.compile_structural_tag(json.dumps(tag))

    @staticmethod
    def _whitespace(spec: StructuredOutputsParams) -> dict[str, Any]:
        """JSON whitespace: none with disable_any_whitespace, else at most MAX_WHITESPACE characters
        between two tokens of JSON (pretty-printing fits; a model cannot loop on newlines forever)."""
        if spec.disable_any_whitespace:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile(spec), spec)

    def fill_bitmask(self, states: list[GrammarState]) -> torch.Tensor:
        """(len(states), ceil(vocab / 32)) int32: bit j of word w of row i set when token 32w + j may
        follow what sequence i has generated. A state whose grammar has ended allows everything (its
        sequence is finishing; the token is dropped)."""
        bitmask = self._xgr.allocate_token_bitmask(len(states), self.vocab_size)
        live = [i for i, s in enumerate(states) if not s.matcher.is_terminated()]
        if live:
            self._batch.batch_fill_next_token_bitmask([states[i].matcher for i in live], bitmask, indices=live)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
