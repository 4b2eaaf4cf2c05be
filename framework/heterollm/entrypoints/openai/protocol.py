"""OpenAI request bodies (plus the vLLM extensions clients rely on) and their translation into
SamplingParams. Bodies are parsed strictly from JSON: a wrong type is a 400 naming the field,
never a silent coercion. A field of OpenAI's or vLLM's schema that does not work is refused with a 400
(fields.py holds the table); other unknown fields are ignored with a warning, as vLLM does."""
from __future__ import annotations

import json
import logging
import math
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from heterollm.entrypoints.openai.fields import REFUSED, refuse_fields
from heterollm.entrypoints.openai.structured import StructuredFields
from heterollm.sampling import SamplingParams, SamplingParamsError

logger = logging.getLogger("heterollm.server")

MAX_N = 128
"""Most completions one request may ask for (n, times the prompts of a batched completion)."""


class BadRequest(ValueError):
    """A request the server refuses; rendered as an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM extension: usage in every chunk, not only the last."""


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (a string key) -> bias added to its logit, clamped to [-100, 100] as vLLM does."""
    best_of: int | None = None
    """Sample best_of (>= n) sequences, return the n with the highest cumulative logprob (not with stream)."""
    bad_words: list[str] | None = None
    """vLLM's: words never generated (SamplingParams.bad_words)."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these tokens may be sampled."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the last k prompt tokens (-1: max_model_len)."""
    priority: int = 0
    """vLLM's field: lower is served first (needs --priority_strategy=priority)."""
    ttft_slo_ms: int | None = None
    """xLLM's field: the time to first token this request wants (the deadline under
    --priority_strategy=deadline; a later first token counts as a missed deadline)."""
    use_beam_search: bool = False
    """vLLM's field: beam search of width n (entrypoints/openai/beam_search.py)."""
    length_penalty: float = 1.0
    """vLLM's field: with use_beam_search, finished beams rank by cum_logprob / len ** length_penalty."""
    prompt_logprobs: int | None = None
    """vLLM's field: 0-20 top alternatives per prompt token (not with stream=true)."""

    def requested_prompt_logprobs(self, echo_logprobs: int | None = None) -> int | None:
        """The prompt logprobs to compute: vLLM's `prompt_logprobs` (0-20; refused with stream=true
        unless 0, as vLLM does, since no chunk carries them) or the echo's, whichever asks for more."""
        asked = self.prompt_logprobs
        if asked is not None:
            if not 0 <= asked <= 20:
                raise BadRequest(f"prompt_logprobs: must be an integer in [0, 20], got {asked}", "prompt_logprobs")
            if self.stream and asked > 0:
                raise BadRequest("prompt_logprobs are not available with stream=true", "prompt_logprobs")
            if self.stream:
                asked = None
        wanted = [k for k in (asked, echo_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def check_common(self) -> None:
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_N:
                raise BadRequest(f"best_of must be between n ({self.n}) and {MAX_N}, got {self.best_of}", "best_of")
            if self.best_of > self.n and self.stream:
                raise BadRequest("best_of > n cannot be streamed: which n sequences are returned is known only "
                                 "when all best_of have finished", "best_of")
        keep = self.truncate_prompt_tokens
        if keep is not None and keep != -1 and keep < 1:
            raise BadRequest(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, got {keep}",
                             "truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        extra = _check_schema_fields(self)
        if extra:
            logger.warning("ignoring unknown request fields: %s", ", ".join(extra))

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None, logprobs_name: str) -> SamplingParams:
        picked = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")
                  if getattr(self, k) is not None}
        kwargs = {**defaults, **picked}
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise BadRequest(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
                min_p=self.min_p if self.min_p is not None else 0.0,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words or [], truncate_prompt_tokens=self.truncate_prompt_tokens,
                best_of=self.best_of, **kwargs)
        except SamplingParamsError as exc:
            name = {"logprobs": logprobs_name}.get(exc.field, exc.field)
            raise BadRequest(str(exc).replace(f"{exc.field}:", f"{name}:", 1), name) from None

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids, each bias clamped to [-100, 100] (vLLM's reading)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise BadRequest(f"logit_bias: the key {key!r} is not a token id (an integer)", "logit_bias") from None
            if not math.isfinite(bias):
                raise BadRequest(f"logit_bias: the bias of token {key} must be a finite number", "logit_bias")
            out[token] = min(100.0, max(-100.0, float(bias)))
        return out


class _RuleFields(_Body):
    """Issue 20's rule (fields.py): the schema fields beyond sampling that work, and the refusals."""

    route: ClassVar[str]
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation (entrypoints/openai/disagg.py): passed to the engine as it is."""


class _CompletionRuleFields(_RuleFields):
    route: ClassVar[str] = "completions"
    add_special_tokens: bool = True


class _ChatRuleFields(_RuleFields):
    route: ClassVar[str] = "chat"
    add_special_tokens: bool = False
    reasoning_effort: str | None = None
    documents: list[dict[str, Any]] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


def _check_schema_fields(body: _Body) -> list[str]:
    """Refuse (BadRequest) a schema field of fields.REFUSED sent with a value that is not neutral; return
    the names of the other fields the request models do not know, to be ignored with a warning."""
    route = getattr(body, "route")
    extra = body.model_extra or {}
    sent = {**extra, **{k: getattr(body, k) for k in body.model_fields_set}}
    refused = refuse_fields(sent, route)
    if refused is not None:
        raise BadRequest(refused[1], refused[0])
    return sorted(k for k in extra if not (k in REFUSED and route in REFUSED[k].routes))


class CompletionRequest(_SamplingFields, _CompletionRuleFields, StructuredFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequest("prompt must not be empty", "prompt")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


MEDIA_PART_TYPES = {"input_audio": "audio", "audio_url": "audio", "video_url": "video", "video": "video",
                    "file": "file"}
"""Content part types of OpenAI's and vLLM's schemas that no served family takes: refused by name."""


def _check_part(where: str, part: Any, role: str) -> bool:
    """One content part of a message: a text part, or (user messages only) an image part; BadRequest
    naming `where` otherwise. Returns whether it is an image part.

    An image part is OpenAI's {"type": "image_url", "image_url": {"url": ..., "detail": ...}} or vLLM's
    short form with `image_url` a URL string; the URL is a data: URL (base64) or an http(s) URL. `detail`
    ("auto", "low", "high") is accepted and does not change processing, as in vLLM: the image is resized
    within the model's pixel budget (min/max pixels, `mm_processor_kwargs`) whatever it says."""
    if not isinstance(part, dict):
        raise BadRequest(f"{where} must be a content part object ({{\"type\": \"text\", ...}}), got "
                         f"{type(part).__name__}", where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.text must be a string", f"{where}.text")
        return False
    if kind in MEDIA_PART_TYPES:
        raise BadRequest(f"{where}: {MEDIA_PART_TYPES[kind]} input ({kind!r} parts) is not supported: the served "
                         f"families take text and images only", where)
    if kind != "image_url":
        raise BadRequest(f"{where}.type must be 'text' or 'image_url', got {kind!r}", f"{where}.type")
    if role != "user":
        raise BadRequest(f"{where}: only a user message carries images, not a {role} message", where)
    url = part.get("image_url")
    if isinstance(url, dict):
        detail = url.get("detail")
        if detail is not None and not isinstance(detail, str):
            raise BadRequest(f"{where}.image_url.detail must be a string", f"{where}.image_url.detail")
        url = url.get("url")
        if not isinstance(url, str):
            raise BadRequest(f"{where}.image_url.url is required: a data: or http(s) URL string",
                             f"{where}.image_url.url")
    elif not isinstance(url, str):
        raise BadRequest(f"{where}.image_url is required: {{\"url\": a data: or http(s) URL}} or the URL string",
                         f"{where}.image_url")
    return True


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    """A string, or a list of content parts: text parts and, in user messages, image_url parts
    (checked by check_messages)."""
    name: str | None = None

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") == "image_url" for p in self.content)

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined into one string; a message
        with images keeps its parts, each image part as {"type": "image_url", "image_url": {"url"}}
        (multimodal.processor.split_images turns those into the template's {"type": "image"})."""
        content = self.content
        if isinstance(content, list):
            if self.has_images():
                content = [{"type": "image_url", "image_url": {"url": _part_url(p)}} if p["type"] == "image_url"
                           else {"type": "text", "text": p["text"]} for p in content]
            else:
                content = "".join(part["text"] for part in content)
        msg = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if isinstance(msg.get("tool_calls"), list):  # templates read the arguments as a mapping (vLLM's reading)
            msg["tool_calls"] = [_template_tool_call(call) for call in msg["tool_calls"]]
        return msg


def _part_url(part: dict[str, Any]) -> str:
    url = part["image_url"]
    return url["url"] if isinstance(url, dict) else url


def image_part_locations(messages: list[ChatMessage]) -> list[str]:
    """`messages.{i}.content.{j}` of each image part, in the order split_images lists the images."""
    return [f"messages.{i}.content.{j}" for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, p in enumerate(m.content) if p.get("type") == "image_url"]


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # left as the string the client sent
    return {**call, "function": fn}


def _check_tool_calls(i: int, calls: Any) -> None:
    """An assistant message's tool_calls: OpenAI's shape, each {id, type "function", function {name, arguments}}."""
    if not isinstance(calls, list):
        raise BadRequest(f"messages.{i}.tool_calls must be a list", f"messages.{i}.tool_calls")
    for j, call in enumerate(calls):
        where = f"messages.{i}.tool_calls.{j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), (str, dict)):
            raise BadRequest(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             f"\"arguments\"}}}} with a string name and arguments", f"{where}.function")


def check_messages(messages: list[ChatMessage]) -> None:
    if not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise BadRequest(f"messages.{i}.content is required for a {m.role} message", f"messages.{i}.content")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            _check_part(f"messages.{i}.content.{j}", part, m.role)
        calls = (m.model_extra or {}).get("tool_calls")
        if calls is not None:
            if m.role != "assistant":
                raise BadRequest(f"messages.{i}.tool_calls: only an assistant message calls tools",
                                 f"messages.{i}.tool_calls")
            _check_tool_calls(i, calls)


class ChatCompletionRequest(_SamplingFields, _ChatRuleFields, StructuredFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    """OpenAI's function tools (entrypoints/openai/tools.py checks them)."""
    tool_choice: Any = None
    """"auto" (the default with tools), "none", "required" or {"type": "function", "function": {"name"}}."""
    parallel_tool_calls: bool | None = None
    """false: at most one call (the first; `required` is constrained to one)."""
    include_reasoning: bool | None = None
    """vLLM's: false leaves reasoning_content out (needs --reasoning_parser)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """vLLM's: the image processor's pixel budget for this request's images (min_pixels / max_pixels,
    or FastDeploy's image_min_pixels / image_max_pixels), over --mm_processor_kwargs."""
    mm_download_headers: dict[str, str] | None = None
    """heterollm's (vLLM has no such field): HTTP headers sent when fetching this request's http(s)
    image URLs, each overriding the same header of --mm_download_headers (names case-insensitive)."""

    def check(self) -> None:
        self.check_common()
        check_messages(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest("continue_final_message and add_generation_prompt cannot both be true",
                             "continue_final_message")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_download_headers: dict[str, str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts: text parts ({\"type\": \"text\", \"text\": ...}) "
               "and image parts ({\"type\": \"image_url\", \"image_url\": {\"url\": ...}})",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(x) for x in loc if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x))]
    return ".".join(parts) or None


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """Raw request bytes -> the model, or BadRequest naming what is wrong."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        if first["type"] == "json_invalid":
            raise BadRequest(f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}") \
                from None
        if first["type"] == "model_type" and not first["loc"]:
            raise BadRequest("the request body must be a JSON object") from None
        param = _param(first["loc"])
        leaf = param.split(".")[-1] if param else None
        top = (param or "").split(".")[0]
        siblings = [e for e in errors if (_param(e["loc"]) or "").split(".")[0] == top]
        if first["type"] == "missing":
            message = f"{param} is required"
        elif leaf in _UNION_HINTS and len(siblings) > 1:
            message = f"{param} {_UNION_HINTS[leaf]}"
        elif first["type"] == "literal_error":
            message = f"{param}: {first['msg'].lower()}, got {first.get('input')!r}"
        else:
            message = f"{param}: {first['msg'].lower()}"
        raise BadRequest(message, param) from None
