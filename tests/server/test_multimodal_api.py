"""Images over the OpenAI API (issue 25): the official `openai` client sends `image_url` parts (a data:
URL, an http URL served here) to a tiny random Qwen2-VL behind an engine-core process (`heterollm
serve`'s layout) and to the in-process engine; the answer's token ids equal transformers' greedy on
the same rendered prompt, streamed and not. --mm_download_headers and the request's
mm_download_headers reach the image server. Broken images, audio parts, too many images, a 404 URL
and an image on a text-only model are 400s naming the part, and never hurt a concurrent request."""
from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from conftest import MODEL, make_engine, serving, serving_cores
import helpers
from helpers import IMAGE_PLACEHOLDER, build_tiny_vlm, hf_vlm_greedy
from heterollm.config import load_config

LAUNCH_HEADERS = {"Authorization": "Bearer launch-token", "X-Launch": "yes"}
TEXT = "What is in it?"
MAX_TOKENS = 6


# tests/helpers' random RGB image (named test_image before; the name kept pytest from collecting it here)
make_image = getattr(helpers, "random_image", None) or getattr(helpers, "test_image")


def _png(seed: int, width: int = 56, height: int = 84) -> bytes:
    buf = io.BytesIO()
    make_image(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_chat(*urls: str, text: str = TEXT) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u, "detail": "low"}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def rendered(n_images: int = 1, text: str = TEXT) -> str:
    """The prompt the folder's chat template renders for image_chat (tests/helpers.VLM_CHAT_TEMPLATE)."""
    return f"<|im_start|>user\n{IMAGE_PLACEHOLDER * n_images}{text}<|im_end|>\n<|im_start|>assistant\n"


class ImageServer:
    """A local http server: /launch.png needs the launch headers, /mine.png needs the per-request
    Authorization plus the launch's X-Launch (so the two were merged), anything else is 404."""

    def __init__(self, png: bytes) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                seen.append((self.path, dict(self.headers)))
                auth, launch = self.headers.get("Authorization"), self.headers.get("X-Launch")
                ok = {"/launch.png": auth == LAUNCH_HEADERS["Authorization"] and launch == "yes",
                      "/mine.png": auth == "Bearer mine" and launch == "yes"}.get(self.path)
                if ok is None:
                    self.send_error(404)
                    return
                if not ok:
                    self.send_error(401)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2-vl", "qwen2_vl")


@pytest.fixture(scope="module")
def png() -> bytes:
    return _png(0)


@pytest.fixture(scope="module")
def expected(vlm, png):
    """transformers' (prompt ids, greedy tokens) on the rendered prompt with the image."""
    from PIL import Image

    prompt_ids, new, _ = hf_vlm_greedy(vlm, rendered(), [Image.open(io.BytesIO(png)).convert("RGB")], MAX_TOKENS)
    return prompt_ids, new


@pytest.fixture(scope="module")
def images(png) -> Iterator[ImageServer]:
    server = ImageServer(png)
    yield server
    server.close()


FLAGS = {"dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 512, "max_model_len": 512,
         "limit_image_per_prompt": 1, "mm_download_headers": json.dumps(LAUNCH_HEADERS)}


@pytest.fixture(scope="module")
def core(vlm):
    """The VLM behind an engine-core process (the images cross the IPC as MultiModalItem wire dicts)."""
    with serving_cores(load_config([], overrides={"model": str(vlm), **FLAGS}).config) as running:
        yield running


@pytest.fixture(scope="module")
def local(vlm):
    """The VLM in this process (AsyncEngine)."""
    with serving(make_engine(vlm, **FLAGS)) as running:
        yield running


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(running, messages, **extra):
    return client(running).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"min_tokens": MAX_TOKENS, "return_token_ids": True, **extra})


@pytest.mark.parametrize("where", ["core", "local"])
def test_data_url_image_answers_as_transformers(request, where, vlm, png, expected):
    running = request.getfixturevalue(where)
    prompt_ids, new = expected
    out = chat(running, image_chat(data_url(png)))
    choice = out.choices[0]
    assert out.model_extra["prompt_token_ids"] == prompt_ids  # the placeholder expanded as transformers does
    assert choice.model_extra["token_ids"] == new
    tok = running.engine.tokenizer
    assert choice.message.content == tok.decode(new, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt_ids)


def test_the_short_form_image_part_answers_as_the_long_form(local, png, expected):
    """vLLM's short form, `image_url` the URL string itself, is the same image."""
    r = httpx.post(local.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "min_tokens": MAX_TOKENS, "return_token_ids": True,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": data_url(png)},
                                                  {"type": "text", "text": TEXT}]}]})
    assert r.status_code == 200, r.text
    assert (r.json()["prompt_token_ids"], r.json()["choices"][0]["token_ids"]) == expected


def test_streamed_image_chat_equals_transformers(core, png, expected):
    stream = client(core).chat.completions.create(
        model=MODEL, messages=image_chat(data_url(png)), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"min_tokens": MAX_TOKENS, "return_token_ids": True})
    ids, text = [], ""
    for chunk in stream:
        for c in chunk.choices:
            ids += (c.model_extra or {}).get("token_ids") or []
            text += c.delta.content or ""
    assert ids == expected[1]
    assert text == core.engine.tokenizer.decode(expected[1], skip_special_tokens=True)


def test_http_url_with_launch_and_request_headers(core, images, expected):
    out = chat(core, image_chat(images.url + "/launch.png"))  # --mm_download_headers alone
    assert out.choices[0].model_extra["token_ids"] == expected[1]
    out = chat(core, image_chat(images.url + "/mine.png"), mm_download_headers={"authorization": "Bearer mine"})
    assert out.choices[0].model_extra["token_ids"] == expected[1]
    sent = dict(images.seen[-1][1])
    assert sent["authorization"] == "Bearer mine" and sent["X-Launch"] == "yes"
    # without the request's header the image server says 401: a 400 naming the part
    r = httpx.post(core.url + "/v1/chat/completions", json={"messages": image_chat(images.url + "/mine.png"),
                                                             "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0", r.text


def _bad_cases(images) -> list[tuple[dict, str, str]]:
    """(body, param, words in the message) for requests each refused with a 400."""
    good = data_url(_png(1))
    return [
        ({"messages": image_chat("data:image/png;base64,@@not-base64@@")}, "messages.0.content.0", "base64"),
        ({"messages": image_chat(data_url(b"this is no image"))}, "messages.0.content.0", "image"),
        ({"messages": image_chat(images.url + "/missing.png")}, "messages.0.content.0", "404"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio",
                                                     "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
         "messages.0.content.1", "audio"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": good}}]}]},
         "messages.0.content.0", "video"),
        ({"messages": image_chat(good, good)}, "messages", "limit of 1"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0.image_url",
         "required"),
        ({"messages": image_chat(good), "mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs",
         "num_crops"),
        ({"messages": image_chat(good), "mm_download_headers": {"X": 1}}, "mm_download_headers.X", "string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": good, "detail": 5}}]}]},
         "messages.0.content.0.image_url.detail", "must be a string"),
    ]


def test_bad_images_are_400s_naming_the_part_while_a_good_request_runs(core, images, png, expected):
    results: list = []
    good = threading.Thread(target=lambda: results.append(chat(core, image_chat(data_url(png)))))
    good.start()
    for body, param, words in _bad_cases(images):
        r = httpx.post(core.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (param, err)
    good.join(120)
    assert results and results[0].choices[0].model_extra["token_ids"] == expected[1]
    assert httpx.get(core.url + "/health").status_code == 200


def test_mm_processor_kwargs_reach_the_image_processor(core, png):
    """A smaller max_pixels makes fewer placeholder tokens (the 56 x 84 image is 6 merged patches; 4 at most)."""
    small = chat(core, image_chat(data_url(png)), mm_processor_kwargs={"min_pixels": 784, "max_pixels": 4 * 784})
    full = chat(core, image_chat(data_url(png)))
    assert small.usage.prompt_tokens < full.usage.prompt_tokens


def test_an_image_on_a_text_only_model_is_a_400(srv, png):
    with pytest.raises(openai.BadRequestError) as err:
        client(srv).chat.completions.create(model=MODEL, messages=image_chat(data_url(png)), max_tokens=2)
    body = err.value.body
    assert body["param"] == "messages.0.content.0" and "text-only" in body["message"], body
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "mm_processor_kwargs": {"max_pixels": 784}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mm_processor_kwargs", r.text


def test_an_image_refusal_names_the_part_at_fault():
    """The multimodal processor names images by their order in the chat (messages.image.K...); the
    server turns that into the message part (worked by hand from two image parts)."""
    from heterollm.entrypoints.openai.server import _image_field

    parts = ["messages.0.content.1", "messages.2.content.0"]
    assert _image_field("messages.image.1", parts, False) == "messages.2.content.0"
    assert _image_field("messages.image.0.image_url.url", parts, False) == "messages.0.content.1.image_url.url"
    assert _image_field("messages.image", parts, False) == "messages"  # the images as a whole (too many)
    assert _image_field("messages.image.2", parts, False) == "messages"  # no such part: the whole
    assert _image_field("messages.image", parts, True) == "messages.0.content.1"  # text-only: the first part
    assert _image_field("messages.image", [], True) == "messages"
    assert _image_field("max_tokens", parts, False) == "max_tokens"  # not about images: as it was
