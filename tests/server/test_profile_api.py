"""POST /start_profile and /stop_profile (--enable_online_profile): the trace holds the request's
operators; out of order, a 400 naming the state; without the flag, a 400 naming it."""
from __future__ import annotations

import gzip
import json

import httpx

from conftest import make_engine, serving
from helpers import TRACED_FORWARD as FORWARD
from heterollm.profiling import TORCH_TRACE_SUFFIX


def operators(path: str) -> set[str]:
    with gzip.open(path, "rt") as fh:
        return {e.get("name", "") for e in json.load(fh)["traceEvents"] if "::" in e.get("name", "")}


def test_the_http_routes(tiny_llama, tmp_path):
    with serving(make_engine(tiny_llama, enable_online_profile=True, profile_dir=str(tmp_path))) as srv:
        assert httpx.post(f"{srv.url}/stop_profile", timeout=60).json()["error"]["param"] == "profile"
        r = httpx.post(f"{srv.url}/start_profile", timeout=60)
        assert r.status_code == 200 and r.json() == {"status": "started"}, r.text
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{srv.url}/stop_profile", timeout=60)
        assert r.status_code == 200, r.text
        traces = r.json()["traces"]
        assert len(traces) == 1 and FORWARD <= operators(traces[0])
    with serving(make_engine(tiny_llama)) as srv:
        r = httpx.post(f"{srv.url}/start_profile", timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "enable_online_profile", r.text


def test_a_profile_still_recording_is_written_when_the_server_stops(tiny_llama, tmp_path):
    """Started over HTTP and never stopped: the server's shutdown writes it. It used to stop the
    profiler from the shutdown's thread, not the engine's, and torch crashed the process (SIGSEGV)."""
    with serving(make_engine(tiny_llama, enable_online_profile=True, profile_dir=str(tmp_path))) as srv:
        assert httpx.post(f"{srv.url}/start_profile", timeout=60).status_code == 200
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200, r.text
    [trace] = tmp_path.glob("*" + TORCH_TRACE_SUFFIX)
    assert FORWARD <= operators(str(trace))
