"""Obtaining an image from what a user sends: an OpenAI `image_url` (a `data:` URL or an `http(s)`
URL), raw bytes or a PIL image from the offline API. Every failure is a `MediaError` (HTTP 400)
naming the request field. Fetching uses the standard library only, with one whole-download
deadline, a body-size limit and redirects counted here (never followed silently)."""
from __future__ import annotations

import base64
import binascii
import functools
import http.client
import io
import json
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union
from urllib.parse import SplitResult, unquote_to_bytes, urljoin, urlsplit

from PIL import Image

from heterollm.scheduler.request import RequestRejected

ImageSource = Union[str, bytes, bytearray, memoryview, Image.Image]
"""What `load_image` accepts: a URL string, encoded image bytes, or a PIL image."""

_CHUNK = 64 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 token
_USER_AGENT = "heterollm-media/1"


class MediaError(RequestRejected):
    """An image the engine cannot use; `field` names the request field (HTTP 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(field_name, message, 400)


@dataclass(frozen=True)
class FetchPolicy:
    """Limits on obtaining one image. All limits apply per image."""

    timeout_s: float = 10.0
    """Deadline for the whole download (connect, every redirect hop, headers and body together)."""
    max_bytes: int = 20 * 2**20
    """Largest encoded image accepted: checked on Content-Length and on the bytes actually read."""
    max_redirects: int = 5
    """Most redirect hops followed; more, or a URL seen twice, is refused."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Service-level request headers (--mm_download_headers); per-request headers override them."""
    max_pixels: int = 50_000_000
    """Decompression-bomb guard: an image whose width * height exceeds it is refused before decoding."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_bytes", "max_pixels"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FetchPolicy.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_redirects < 0:
            raise ValueError(f"FetchPolicy.max_redirects must be >= 0, got {self.max_redirects!r}")


# ---------------------------------------------------------------------------------------------
# Headers


def parse_download_headers(value: str) -> dict[str, str]:
    """--mm_download_headers: "" (or blank) -> {}; else a JSON object of header name -> string value.
    Raises ValueError whose message starts with "--mm_download_headers:" for anything else (bad JSON,
    not an object, a non-string value, an illegal header name or value, a name given twice)."""
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--mm_download_headers: not valid JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise ValueError("--mm_download_headers: expected a JSON object of header name to value, "
                         f"got a JSON {type(parsed).__name__}")
    seen: set[str] = set()
    for name, header_value in parsed.items():
        problem = _header_problem(name, header_value)
        if problem is None and name.lower() in seen:
            problem = f"header {name!r} is given twice (names are case-insensitive)"
        if problem is not None:
            raise ValueError(f"--mm_download_headers: {problem}")
        seen.add(name.lower())
    return dict(parsed)


def _header_problem(name: str, value: object) -> str | None:
    """Why (name, value) cannot be sent as an HTTP header, or None when it can."""
    if not _HEADER_NAME.match(name):
        return f"{name!r} is not a legal header name"
    if not isinstance(value, str):
        return f"the value of {name!r} is a {type(value).__name__}, not a string"
    if any(c in value for c in "\r\n\0"):
        return f"the value of {name!r} contains a line break or NUL"
    return None


def _merge_headers(defaults: Mapping[str, str], overrides: Mapping[str, str] | None,
                   field_name: str) -> dict[str, str]:
    """defaults overlaid with overrides, key by key, names compared case-insensitively (the
    override's spelling wins). A header that cannot be sent -> MediaError."""
    merged: dict[str, tuple[str, str]] = {"user-agent": ("User-Agent", _USER_AGENT)}
    for source in (defaults, overrides or {}):
        for name, value in source.items():
            problem = _header_problem(name, value)
            if problem is not None:
                raise MediaError(field_name, f"download header: {problem}")
            merged[name.lower()] = (name, value)
    return dict(merged.values())


# ---------------------------------------------------------------------------------------------
# Entry points


def load_image(source: ImageSource, field_name: str, policy: FetchPolicy,
               headers: Mapping[str, str] | None = None) -> Image.Image:
    """The RGB image `source` denotes, fully loaded (pixels in memory, no open file behind it).

    source: a `data:image/...;base64,...` URL, an `http://` / `https://` URL, encoded image bytes, or
    a PIL image (copied, never mutated). `headers` (per request) override `policy.headers` key by key.
    Animated images give their first frame; alpha is dropped. Any failure -> MediaError(field_name)."""
    if isinstance(source, Image.Image):
        return _to_rgb(source, field_name, policy)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        _check_size(len(data), field_name, policy, "image data")
        return _decode(data, field_name, policy)
    if isinstance(source, str):
        return _decode(_read_url(source.strip(), field_name, policy, headers), field_name, policy)
    raise MediaError(field_name, "an image must be a URL string, bytes or a PIL image, "
                                 f"not {type(source).__name__}")


# ---------------------------------------------------------------------------------------------
# URLs


def _read_url(url: str, field_name: str, policy: FetchPolicy,
              headers: Mapping[str, str] | None) -> bytes:
    """The encoded image bytes a data: or http(s): URL holds; any other scheme -> MediaError."""
    scheme = _scheme(url)
    if scheme == "data":
        return _read_data_url(url, field_name, policy)
    if scheme in ("http", "https"):
        return _fetch(url, field_name, policy, _merge_headers(policy.headers, headers, field_name))
    if not scheme:
        raise MediaError(field_name, f"not a URL: {_preview(url)!r} (expected data:, http:// or https://)")
    raise MediaError(field_name, f"unsupported URL scheme {scheme!r}: use data:, http:// or https://")


def _scheme(url: str) -> str:
    """The lower-cased scheme of url ('' when it has none)."""
    head, sep, _ = url.partition(":")
    return head.lower() if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", head) else ""


def _preview(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _read_data_url(url: str, field_name: str, policy: FetchPolicy) -> bytes:
    """The payload of `data:<image/...>[;base64],<data>`; a non-image media type, malformed base64 or
    a payload over policy.max_bytes -> MediaError."""
    meta, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError(field_name, "malformed data URL: no ',' before the data")
    params = [p.strip().lower() for p in meta.split(";")]
    media_type = params[0]
    if not media_type.startswith("image/"):
        raise MediaError(field_name, f"data URL media type is {media_type or 'text/plain (none given)'!r}, "
                                     "not an image type (image/...)")
    if "base64" not in params[1:]:
        data = unquote_to_bytes(payload)
    else:
        compact = "".join(payload.split())
        _check_size(len(compact) * 3 // 4, field_name, policy, "data URL image")
        try:
            data = base64.b64decode(compact, validate=True)
        except binascii.Error as e:
            raise MediaError(field_name, f"data URL is not valid base64: {e}") from None
    _check_size(len(data), field_name, policy, "data URL image")
    return data


def _check_size(num_bytes: int, field_name: str, policy: FetchPolicy, what: str) -> None:
    if num_bytes > policy.max_bytes:
        raise MediaError(field_name, f"{what} is {num_bytes} bytes, over the limit of "
                                     f"{policy.max_bytes} bytes")


# ---------------------------------------------------------------------------------------------
# HTTP fetching


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read given only the time left before `deadline` (time.monotonic()).
    It reads through the socket's own file object, so the socket stays open while this reader is
    open even after the connection lets go of it (what http.client relies on)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int | None:  # type: ignore[override]
        self._sock.settimeout(_remaining(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    """An HTTPResponse whose status line, headers and body all read against one deadline."""

    def __init__(self, sock: socket.socket, debuglevel: int = 0, method: str | None = None,
                 url: str | None = None, *, deadline: float) -> None:
        super().__init__(sock, debuglevel, method, url)
        self.fp.close()  # HTTPResponse's plain file on the socket; ours replaces it
        self.fp = io.BufferedReader(_DeadlineReader(sock, deadline))


def _remaining(deadline: float) -> float:
    """Seconds left before deadline; none left -> TimeoutError."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _fetch(url: str, field_name: str, policy: FetchPolicy, headers: dict[str, str]) -> bytes:
    """The body at url, following at most policy.max_redirects redirects, all within one
    policy.timeout_s deadline. Credentials (Authorization, Cookie) are not sent to another origin."""
    deadline = time.monotonic() + policy.timeout_s
    seen = {url}
    for hop in range(policy.max_redirects + 1):
        location, body = _get_once(url, field_name, policy, headers, deadline)
        if location is None:
            return body
        target = urljoin(url, location)
        if _scheme(target) not in ("http", "https"):
            raise MediaError(field_name, f"{url} redirects to unsupported URL scheme {_scheme(target)!r}")
        if target in seen:
            raise MediaError(field_name, f"redirect loop: {url} redirects back to {target}")
        if hop == policy.max_redirects:
            raise MediaError(field_name,
                             f"too many redirects fetching the image (limit {policy.max_redirects})")
        if _origin(urlsplit(target)) != _origin(urlsplit(url)):
            headers = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIAL_HEADERS}
        seen.add(target)
        url = target
    raise AssertionError("unreachable: the loop returns or raises")


def _origin(parts: SplitResult) -> tuple[str, str | None, int | None]:
    return parts.scheme.lower(), parts.hostname, parts.port


def _get_once(url: str, field_name: str, policy: FetchPolicy, headers: dict[str, str],
              deadline: float) -> tuple[str | None, bytes]:
    """One GET: (Location, b"") for a redirect, else (None, body). Status >= 400, timeouts, refused
    connections, oversized bodies and broken HTTP -> MediaError."""
    try:
        conn = _connect(url, deadline)
        try:
            conn.request("GET", _request_target(urlsplit(url)), headers=headers)
            response = conn.getresponse()
            return _read_response(response, url, field_name, policy)
        finally:
            conn.close()
    except MediaError:
        raise
    except TimeoutError:
        raise MediaError(field_name, f"fetching {url} timed out after {policy.timeout_s:g} s") from None
    except ConnectionRefusedError:
        raise MediaError(field_name, f"fetching {url} failed: connection refused") from None
    except (OSError, http.client.HTTPException, ValueError) as e:  # ValueError: a malformed URL or port
        raise MediaError(field_name, f"fetching {url} failed: {type(e).__name__}: {e}") from None


def _connect(url: str, deadline: float) -> http.client.HTTPConnection:
    """An open connection to url's host whose responses read against deadline."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError("the URL has no host")
    cls = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=_remaining(deadline))
    conn.response_class = functools.partial(_DeadlineResponse, deadline=deadline)  # type: ignore[assignment]
    conn.connect()
    return conn


def _request_target(parts: SplitResult) -> str:
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _read_response(response: http.client.HTTPResponse, url: str, field_name: str,
                   policy: FetchPolicy) -> tuple[str | None, bytes]:
    """Classify a response by status, then read its body under policy.max_bytes."""
    status = response.status
    if status in _REDIRECT_STATUSES:
        location = response.getheader("Location")
        if not location:
            raise MediaError(field_name, f"fetching {url}: HTTP {status} redirect without a Location")
        return location, b""
    if status >= 400:
        raise MediaError(field_name, f"fetching {url} failed: HTTP {status} {response.reason}".rstrip())
    if status >= 300:
        raise MediaError(field_name, f"fetching {url}: unexpected HTTP {status} {response.reason}".rstrip())
    if response.length is not None:
        _check_size(response.length, field_name, policy, f"the body of {url} (Content-Length)")
    return None, _read_body(response, url, field_name, policy)


def _read_body(response: http.client.HTTPResponse, url: str, field_name: str,
               policy: FetchPolicy) -> bytes:
    """The body, read in chunks; refused as soon as more than policy.max_bytes have arrived."""
    chunks: list[bytes] = []
    total = 0
    while chunk := response.read(_CHUNK):
        total += len(chunk)
        if total > policy.max_bytes:
            raise MediaError(field_name, f"the body of {url} exceeds the limit of {policy.max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------
# Decoding


def _decode(data: bytes, field_name: str, policy: FetchPolicy) -> Image.Image:
    """The RGB image encoded in data; undecodable data or too many pixels -> MediaError."""
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaError(field_name, f"image too large: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise MediaError(field_name, f"not a decodable image: {_pil_reason(e)}") from None
    return _to_rgb(image, field_name, policy)


def _to_rgb(image: Image.Image, field_name: str, policy: FetchPolicy) -> Image.Image:
    """A loaded RGB copy of image's first frame; pixels over policy.max_pixels or a decode failure
    -> MediaError."""
    width, height = image.size
    if width * height > policy.max_pixels:
        raise MediaError(field_name, f"image too large: {width}x{height} = {width * height} pixels, "
                                     f"over the limit of {policy.max_pixels}")
    try:
        image.seek(0)
        if image.mode == "P" and "transparency" in image.info:
            image = image.convert("RGBA")
        rgb = image.convert("RGB")
        rgb.load()
    except Image.DecompressionBombError as e:
        raise MediaError(field_name, f"image too large: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise MediaError(field_name, f"not a decodable image: {_pil_reason(e)}") from None
    return rgb


def _pil_reason(error: Exception) -> str:
    """PIL's message without the repr of our in-memory buffer (`<_io.BytesIO object at 0x...>`)."""
    return re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(error)) or type(error).__name__
