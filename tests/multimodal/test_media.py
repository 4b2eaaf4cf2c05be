"""heterollm.multimodal.media: obtaining an image from a data URL, an http URL (a real local server
with slow, oversized, redirecting and authenticated routes), bytes or a PIL image; every failure a
MediaError naming the field. The whole file runs in a few seconds."""
from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from heterollm.multimodal.media import (FetchPolicy, MediaError, load_image,
                                        parse_download_headers)

FIELD = "messages[0].content[1].image_url"
SMALL = FetchPolicy(timeout_s=5.0, max_bytes=3000)


def _pattern(size: tuple[int, int] = (7, 5), mode: str = "RGB") -> Image.Image:
    """A small image whose every pixel differs from its neighbours (so encodings can't blur it)."""
    image = Image.new("RGB", size)
    image.putdata([((x * 37) % 256, (y * 71) % 256, (x * y * 13) % 256)
                   for y in range(size[1]) for x in range(size[0])])
    return image.convert(mode)


def _encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = _encode(_pattern(), "PNG")


def _expect_error(source: object, policy: FetchPolicy, *fragments: str,
                  headers: dict[str, str] | None = None) -> MediaError:
    """load_image(source) raises a MediaError naming FIELD whose message holds every fragment."""
    with pytest.raises(MediaError) as info:
        load_image(source, FIELD, policy, headers)  # type: ignore[arg-type]
    assert info.value.field == FIELD and info.value.status == 400
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return info.value


# ---------------------------------------------------------------------------------------------
# A local HTTP server


class _Handler(BaseHTTPRequestHandler):
    """Routes: /ok.png, /ok-chunked.png, /slow, /slow-headers, /big, /big-chunked, /loop, /hops/N,
    /missing, /notimage, /auth, /to-other-origin, /to-file."""

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        name = self.path.strip("/").split("/")[0].replace("-", "_").replace(".", "_")
        route = getattr(self, "_route_" + name, None)
        (route or self._route_missing)()

    def _send(self, status: int, body: bytes, content_type: str = "image/png",
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self._send(302, b"", "text/plain", {"Location": location})

    def _trickle(self, seconds: float = 5.0) -> None:
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:  # the client gave up
            pass

    def _route_ok_png(self) -> None:
        self._send(200, PNG)

    def _route_ok_chunked_png(self) -> None:
        self._send_chunked([PNG[i:i + 100] for i in range(0, len(PNG), 100)])

    def _route_big_chunked(self) -> None:
        self._send_chunked([PNG] + [b"\0" * 1000] * 8)  # a valid PNG, then 8000 bytes of padding

    def _send_chunked(self, chunks: list[bytes]) -> None:
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def _route_slow(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self._trickle()

    def _route_slow_headers(self) -> None:
        self.wfile.write(b"HTTP/1.0 200 OK\r\n")
        try:
            for i in range(25):
                self.wfile.write(b"X-Slow-%d: y\r\n" % i)
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    def _route_big(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", "10000000")
        self.end_headers()
        self._trickle(2.0)  # never sends the body: the loader must refuse on the header alone

    def _route_loop(self) -> None:
        self._redirect("/loop")

    def _route_hops(self) -> None:
        left = int(self.path.rsplit("/", 1)[1])
        if left == 0:
            self._send(200, PNG)
        else:
            self._redirect(f"/hops/{left - 1}")

    def _route_missing(self) -> None:
        self._send(404, b"not here", "text/plain")

    def _route_notimage(self) -> None:
        self._send(200, b"hello, I am text", "text/plain")

    def _route_auth(self) -> None:
        if self.headers.get("Authorization") == "Bearer x":
            self._send(200, PNG)
        else:
            self._send(403, b"forbidden", "text/plain")

    def _route_to_other_origin(self) -> None:
        self._redirect(f"http://localhost:{self.server.server_address[1]}/auth")

    def _route_to_file(self) -> None:
        self._redirect("file:///etc/passwd")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# ---------------------------------------------------------------------------------------------
# http(s)


def test_http_png_loads_as_the_same_pixels(base_url: str) -> None:
    image = load_image(f"{base_url}/ok.png", FIELD, SMALL)
    assert image.mode == "RGB" and image.size == (7, 5)
    assert image.tobytes() == _pattern().tobytes()


def test_chunked_transfer_encoding_is_read(base_url: str) -> None:
    assert load_image(f"{base_url}/ok-chunked.png", FIELD, SMALL).tobytes() == _pattern().tobytes()


def test_slow_body_is_cut_at_the_whole_download_deadline(base_url: str) -> None:
    start = time.monotonic()
    _expect_error(f"{base_url}/slow", FetchPolicy(timeout_s=1.0), "timed out after 1 s", "/slow")
    assert 0.9 <= time.monotonic() - start < 1.5


def test_slow_headers_are_cut_at_the_deadline_too(base_url: str) -> None:
    start = time.monotonic()
    _expect_error(f"{base_url}/slow-headers", FetchPolicy(timeout_s=1.0), "timed out after 1 s")
    assert time.monotonic() - start < 1.5


def test_content_length_over_the_limit_is_refused_before_reading(base_url: str) -> None:
    start = time.monotonic()
    _expect_error(f"{base_url}/big", SMALL, "10000000 bytes", "limit of 3000 bytes", "Content-Length")
    assert time.monotonic() - start < 1.0  # the server never sends the body


def test_streamed_body_over_the_limit_is_refused(base_url: str) -> None:
    _expect_error(f"{base_url}/big-chunked", SMALL, "exceeds the limit of 3000 bytes")


def test_redirect_loop_is_refused(base_url: str) -> None:
    _expect_error(f"{base_url}/loop", SMALL, "redirect loop")


@pytest.mark.parametrize("hops", [0, 3, 5])
def test_redirect_chain_within_the_limit_is_followed(base_url: str, hops: int) -> None:
    image = load_image(f"{base_url}/hops/{hops}", FIELD, FetchPolicy(max_redirects=5))
    assert image.tobytes() == _pattern().tobytes()


@pytest.mark.parametrize("hops, limit", [(6, 5), (1, 0)])
def test_too_many_redirects_are_refused(base_url: str, hops: int, limit: int) -> None:
    _expect_error(f"{base_url}/hops/{hops}", FetchPolicy(max_redirects=limit),
                  f"too many redirects fetching the image (limit {limit})")


def test_redirect_to_another_scheme_is_refused(base_url: str) -> None:
    _expect_error(f"{base_url}/to-file", SMALL, "redirects to unsupported URL scheme 'file'")


def test_http_error_status_is_named(base_url: str) -> None:
    _expect_error(f"{base_url}/missing", SMALL, "HTTP 404", "/missing")


def test_body_that_is_not_an_image_is_refused(base_url: str) -> None:
    _expect_error(f"{base_url}/notimage", SMALL, "not a decodable image", "cannot identify image file")


def test_connection_refused_is_named() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _expect_error(f"http://127.0.0.1:{port}/x.png", SMALL, "connection refused")


def test_service_headers_are_sent(base_url: str) -> None:
    _expect_error(f"{base_url}/auth", SMALL, "HTTP 403")
    policy = FetchPolicy(headers={"Authorization": "Bearer x"})
    assert load_image(f"{base_url}/auth", FIELD, policy).size == (7, 5)


def test_request_headers_override_service_headers_case_insensitively(base_url: str) -> None:
    wrong = FetchPolicy(headers={"Authorization": "Bearer wrong"})
    assert load_image(f"{base_url}/auth", FIELD, wrong, {"authorization": "Bearer x"}).size == (7, 5)
    right = FetchPolicy(headers={"Authorization": "Bearer x"})
    _expect_error(f"{base_url}/auth", right, "HTTP 403", headers={"AUTHORIZATION": "Bearer y"})


def test_credentials_are_not_sent_to_another_origin(base_url: str) -> None:
    policy = FetchPolicy(headers={"Authorization": "Bearer x"})
    _expect_error(f"{base_url}/to-other-origin", policy, "HTTP 403", "localhost")


def test_request_header_that_cannot_be_sent_is_refused(base_url: str) -> None:
    _expect_error(f"{base_url}/ok.png", SMALL, "download header", "line break",
                  headers={"X-A": "1\r\nX-Injected: 2"})


@pytest.mark.parametrize("url, scheme", [("file:///etc/passwd", "'file'"), ("ftp://host/a.png", "'ftp'"),
                                         ("FILE:///etc/passwd", "'file'")])
def test_unsupported_scheme_is_named(url: str, scheme: str) -> None:
    _expect_error(url, SMALL, f"unsupported URL scheme {scheme}")


def test_string_that_is_not_a_url_is_refused() -> None:
    _expect_error("just a picture of a cat", SMALL, "not a URL")


def test_wrong_source_type_is_refused() -> None:
    _expect_error(12, SMALL, "not int")


# ---------------------------------------------------------------------------------------------
# data: URLs and bytes


def test_png_data_url_loads_exactly() -> None:
    assert load_image(_data_url(PNG, "image/png"), FIELD, SMALL).tobytes() == _pattern().tobytes()


def test_jpeg_data_url_loads_as_rgb() -> None:
    solid = Image.new("RGB", (16, 8), (200, 30, 60))
    image = load_image(_data_url(_encode(solid, "JPEG", quality=95), "image/jpeg"), FIELD, SMALL)
    assert image.mode == "RGB" and image.size == (16, 8)
    assert all(abs(a - b) <= 4 for a, b in zip(image.getpixel((8, 4)), (200, 30, 60)))


def test_data_url_with_bad_base64_is_refused() -> None:
    _expect_error("data:image/png;base64,iVBOR@@@not-base64", SMALL, "not valid base64")


def test_data_url_that_is_not_an_image_type_is_refused() -> None:
    _expect_error("data:text/plain;base64,aGVsbG8=", SMALL, "media type is 'text/plain'", "image/...")


def test_data_url_without_a_comma_is_refused() -> None:
    _expect_error("data:image/png;base64", SMALL, "malformed data URL")


def test_data_url_image_type_with_non_image_payload_is_refused() -> None:
    _expect_error(_data_url(b"hello", "image/png"), SMALL, "not a decodable image")


def test_data_url_over_the_limit_is_refused() -> None:
    _expect_error(_data_url(b"\0" * 4000, "image/png"), SMALL, "over the limit of 3000 bytes")


def test_bytes_load_and_garbage_bytes_are_refused_without_buffer_repr() -> None:
    assert load_image(PNG, FIELD, SMALL).tobytes() == _pattern().tobytes()
    error = _expect_error(b"GIF89a-but-not-really", SMALL, "not a decodable image")
    assert "BytesIO" not in str(error)


def test_truncated_image_is_refused() -> None:
    big = _encode(_pattern((64, 64)), "PNG")
    _expect_error(big[: len(big) // 2], FetchPolicy(), "not a decodable image")


def test_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    image = load_image(buffer.getvalue(), FIELD, SMALL)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 0, 0)


def test_decompression_bomb_is_refused_before_decoding() -> None:
    policy = FetchPolicy(max_pixels=5000)
    _expect_error(_encode(Image.new("L", (100, 100)), "PNG"), policy, "image too large", "100x100",
                  "limit of 5000")
    _expect_error(Image.new("RGB", (100, 51)), policy, "image too large")
    assert load_image(Image.new("RGB", (100, 50)), FIELD, policy).size == (100, 50)


# ---------------------------------------------------------------------------------------------
# PIL images


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "RGB"])
def test_pil_image_is_converted_to_rgb_without_touching_the_original(mode: str) -> None:
    original = _pattern(mode=mode)
    image = load_image(original, FIELD, SMALL)
    assert image.mode == "RGB" and image.size == original.size
    assert image is not original and original.mode == mode
    assert image.tobytes() == original.convert("RGB").tobytes()


def test_grey_pixel_becomes_equal_channels() -> None:
    assert load_image(Image.new("L", (2, 2), 128), FIELD, SMALL).getpixel((1, 1)) == (128, 128, 128)


# ---------------------------------------------------------------------------------------------
# --mm_download_headers and FetchPolicy


def test_parse_download_headers_accepts_an_object_of_strings() -> None:
    assert parse_download_headers("") == {} and parse_download_headers("  ") == {}
    assert parse_download_headers('{"Authorization": "Bearer x", "X-Trace": ""}') == {
        "Authorization": "Bearer x", "X-Trace": ""}


@pytest.mark.parametrize("value, fragment", [
    ("not json", "not valid JSON"),
    ('["Authorization"]', "expected a JSON object"),
    ('{"X-Count": 3}', "the value of 'X-Count' is a int, not a string"),
    ('{"bad name": "x"}', "'bad name' is not a legal header name"),
    ('{"X-A": "1\\r\\nX-B: 2"}', "contains a line break"),
    ('{"X-A": "1", "x-a": "2"}', "given twice"),
])
def test_parse_download_headers_refuses_with_a_reason(value: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_download_headers(value)
    assert str(info.value).startswith("--mm_download_headers:") and fragment in str(info.value)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"timeout_s": 0}, "timeout_s"), ({"max_bytes": -1}, "max_bytes"),
    ({"max_redirects": -1}, "max_redirects"), ({"max_pixels": 0}, "max_pixels")])
def test_fetch_policy_refuses_nonsense_limits(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ValueError, match=f"FetchPolicy.{fragment}"):
        FetchPolicy(**kwargs)  # type: ignore[arg-type]
