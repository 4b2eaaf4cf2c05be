"""The router's side of prefill/decode disaggregation (README "Disaggregated serving"; the instances'
side is kv_cache/pd.py). The DECODE instance's --kv_cache_transfer_mode picks the protocol: the router
asks the least loaded DECODE instance D for a block reservation, and D answers with one (PUSH) or
with only its mode (PULL; the router remembers it and asks that D no more).

PUSH, one client request:
1. D reserves blocks for the prompt: the client's body with stream false and
   `"kv_transfer_params": {"do_remote_prefill": true, "reserve": true}`, answered at once;
2. the least loaded PREFILL instance P computes the prompt (the body of PULL's step 1, its
   kv_transfer_params D's reservation) and writes the K/V into D's blocks; its answer's
   `kv_transfer_params` says they are there;
3. D gets the client's own body plus P's `kv_transfer_params`; its answer is the client's.
P that cannot be reached: another P. P that could not write (502 kv_transfer_failed): D's reservation
is cancelled and the flow runs once more from step 1 on another D when there is one. D that cannot be
reached in step 3: a 502 (its reservation is freed after its hold timeout).

PULL, one client request:
1. P computes the prompt: the client's body with stream false, max_tokens 1 (chat:
   max_completion_tokens 1 too), n 1, no stream_options and
   `"kv_transfer_params": {"do_remote_decode": true}`; P answers with a top-level `kv_transfer_params`;
2. the least loaded D gets the client's own body plus P's `kv_transfer_params` as they came, pulls
   the KV cache from P and generates; its answer (streamed as the client asked) is the client's answer;
3. after D's answer ends, P is told to release the blocks (POST /v1/kv_transfer/release, best effort).
P that cannot be reached: another P. D that cannot be reached: another D (P's params hold until
released). D that could not pull the KV cache (502 kv_transfer_failed, or that error as a stream's
first event): the whole flow once more on another P when there is one, else that error is the answer.

Every call has a timeout (--connect_timeout, --request_timeout; RELEASE_TIMEOUT_S for a release).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import Response

from heterollm.service.proxy import Proxied, error_response, whole_answer

if TYPE_CHECKING:
    from heterollm.service.pool import Instance
    from heterollm.service.router import Router

logger = logging.getLogger("heterollm.router")

KV_TRANSFER_FAILED = "kv_transfer_failed"
RELEASE_TIMEOUT_S = 5.0


def prefill_body(body: dict[str, Any], chat: bool, reservation: dict[str, Any] | None = None) -> dict[str, Any]:
    """What P computes: the prompt and one token, not streamed, its KV cache kept for a DECODE instance
    (PULL) or written into D's `reservation` (PUSH)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    params = {k: v for k, v in (reservation or {"do_remote_decode": True}).items() if k != "reservation_replica"}
    out.update(stream=False, max_tokens=1, n=1, kv_transfer_params=params)
    if chat:
        out["max_completion_tokens"] = 1
    return out


def reserve_body(body: dict[str, Any]) -> dict[str, Any]:
    """What D is asked first: the client's request (D refuses there what it would refuse later: n > 1,
    logprobs), for a block reservation answered at once."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(stream=False, kv_transfer_params={"do_remote_prefill": True, "reserve": True})
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": params}


def is_transfer_failure(data: bytes) -> bool:
    """`data` (a JSON error body, or SSE events starting with one) is D's kv_transfer_failed error."""
    text = data.decode("utf-8", "replace").strip()
    if text.startswith("data:"):
        text = text.split("\n", 1)[0][len("data:"):].strip()
    try:
        error = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("type") == KV_TRANSFER_FAILED


@dataclass
class _Held:
    """A PREFILL instance's blocks for one request, until released."""

    p: Instance
    params: dict[str, Any]
    """P's kv_transfer_params, for the DECODE instance."""
    headers: dict[str, str]
    """The client's headers (its Authorization), for the release."""


@dataclass
class _Failed:
    """D could not pull the KV cache; `response` is its answer, passed on when no retry is left."""

    response: Response


class PDFlow:
    """Runs the three steps for one request at a time; the router owns the client, pool and policy."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._releases: set[asyncio.Task] = set()

    async def run(self, path: str, body: dict[str, Any], headers: dict[str, str], model: str | None) -> Response:
        tried_d: set[str] = set()
        retried = False
        while True:
            d = self.router.policy.pick(self.router.pool, ("DECODE",), model, tried_d)
            if d is None:
                return error_response(503, "no instance available: no DECODE instance" +
                                      (f" left (failed: {', '.join(sorted(tried_d))})" if tried_d else ""))
            if d.kv_mode == "PULL":
                return await self._run_pull(path, body, headers, model)
            reservation = await self._reserve(d, path, body, headers)
            if reservation is None or (isinstance(reservation, Response) and reservation.status_code == 503
                                       and self.router.policy.pick(self.router.pool, ("DECODE",), model,
                                                                   tried_d | {d.name}) is not None):
                tried_d.add(d.name)  # unreachable, or no room: another DECODE instance
                continue
            if isinstance(reservation, Response):
                return reservation
            if "reservation_id" not in reservation:
                d.kv_mode = reservation.get("kv_cache_transfer_mode", "PULL")
                return await self._run_pull(path, body, headers, model)
            d.kv_mode = "PUSH"
            d.in_flight += 1  # from the reservation to D's answer: P's prefill fills D's blocks meanwhile
            try:
                answer = await self._run_push(path, body, headers, model, d, reservation)
            finally:
                d.in_flight -= 1
            if not isinstance(answer, _Failed):
                return answer
            tried_d.add(d.name)
            if retried or self.router.policy.pick(self.router.pool, ("DECODE",), model, tried_d) is None:
                return answer.response
            logger.warning("the prefill instance could not write into %s's reservation; the request runs again "
                           "on another DECODE instance", d.name)
            retried = True

    async def _reserve(self, d: Instance, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> dict[str, Any] | Response | None:
        """D's answer to the reservation request: its kv_transfer_params, an error to pass on, or None
        when D cannot be reached."""
        router = self.router
        d.in_flight += 1
        try:
            r = await router.client.post(d.url + path, json=reserve_body(body), headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._down(d, exc)
            return None
        except httpx.TimeoutException:
            return error_response(504, f"DECODE instance {d.name} did not answer its reservation within "
                                       f"{router.settings.request_timeout}s")
        except httpx.HTTPError as exc:
            return error_response(502, f"DECODE instance {d.name} failed: {type(exc).__name__}: {exc}")
        finally:
            d.in_flight -= 1
        if r.status_code != 200:  # the client's request is at fault (400), or D has no room (503): passed on
            return whole_answer(r.content, r.status_code, r.headers)
        params = _json(r.content).get("kv_transfer_params")
        if not isinstance(params, dict):
            return error_response(502, f"DECODE instance {d.name} answered its reservation without "
                                       f"kv_transfer_params (is it started with --instance_role DECODE?)")
        return params

    async def _run_push(self, path: str, body: dict[str, Any], headers: dict[str, str], model: str | None,
                        d: Instance, reservation: dict[str, Any]) -> Response | _Failed:
        """Steps 2 and 3 of PUSH: P writes into D's reservation, then D generates."""
        replica = reservation.get("reservation_replica")
        prefill = await self._prefill(path, body, headers, model, set(), reservation)
        if isinstance(prefill, Response):
            failed_push = prefill.status_code == 502 and is_transfer_failure(bytes(prefill.body))
            if not _p_may_still_write(prefill, failed_push):
                self.release(_Held(d, {"remote_request_id": reservation.get("reservation_id")}, headers))
            if failed_push:
                return _Failed(prefill)
            return prefill
        params = {**prefill.params, "reservation_replica": replica}
        answer = await self._decode(path, body, headers, model, _Held(prefill.p, params, headers), fixed=d)
        status = answer.response.status_code if isinstance(answer, _Failed) else answer.status_code
        if status != 200:  # D refused the request before claiming (a full queue ...): free its blocks now
            self.release(_Held(d, {"remote_request_id": reservation.get("reservation_id")}, headers))
        return answer

    async def _run_pull(self, path: str, body: dict[str, Any], headers: dict[str, str],
                        model: str | None) -> Response:
        tried: set[str] = set()
        retried = False
        while True:
            prefill = await self._prefill(path, body, headers, model, tried)
            if isinstance(prefill, Response):
                return prefill
            answer = await self._decode(path, body, headers, model, prefill)
            if not isinstance(answer, _Failed):
                return answer
            p = prefill.p
            tried.add(p.name)
            other = self.router.policy.pick(self.router.pool, ("PREFILL",), model, tried)
            if retried or other is None:
                return answer.response
            logger.warning("decode could not pull the KV cache of %s; the request runs again on another "
                           "PREFILL instance", p.name)
            retried = True

    # -- step 1 ----------------------------------------------------------------------------------
    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str], model: str | None,
                       tried: set[str], reservation: dict[str, Any] | None = None) -> _Held | Response:
        router = self.router
        payload = prefill_body(body, path.endswith("/chat/completions"), reservation)
        while True:
            p = router.policy.pick(router.pool, ("PREFILL",), model, tried)
            if p is None:
                return error_response(503, "no instance available: no PREFILL instance" +
                                      (f" left (failed: {', '.join(sorted(tried))})" if tried else ""))
            p.in_flight += 1
            try:
                r = await router.client.post(p.url + path, json=payload, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._down(p, exc)
                tried.add(p.name)
                continue
            except httpx.TimeoutException:
                return _may_still_run(error_response(504, f"PREFILL instance {p.name} did not answer within "
                                                          f"{router.settings.request_timeout}s"))
            except httpx.HTTPError as exc:
                return _may_still_run(error_response(502, f"PREFILL instance {p.name} failed: "
                                                          f"{type(exc).__name__}: {exc}"))
            finally:
                p.in_flight -= 1
            if r.status_code != 200:  # the client's request is at fault (400 ...), or P is: passed on
                return whole_answer(r.content, r.status_code, r.headers)
            params = _json(r.content).get("kv_transfer_params")
            if not isinstance(params, dict):
                return error_response(502, f"PREFILL instance {p.name} answered without kv_transfer_params "
                                           f"(is it started with --instance_role PREFILL?)")
            return _Held(p, params, headers)

    # -- steps 2 and 3 ---------------------------------------------------------------------------
    async def _decode(self, path: str, body: dict[str, Any], headers: dict[str, str], model: str | None,
                      held: _Held, fixed: Instance | None = None) -> Response | _Failed:
        """D generates (`fixed`: the D that holds the reservation, else the least loaded one)."""
        router = self.router
        payload = decode_body(body, held.params)
        tried: set[str] = set()
        while True:
            d = fixed if fixed is not None else router.policy.pick(router.pool, ("DECODE",), model, tried)
            if fixed is not None and fixed.name in tried:
                return error_response(502, f"DECODE instance {fixed.name}, which holds the request's KV cache, "
                                           f"cannot be reached")
            if d is None:
                self.release(held)
                return error_response(503, "no instance available: no DECODE instance" +
                                      (f" left (failed: {', '.join(sorted(tried))})" if tried else ""))
            d.in_flight += 1
            request = router.client.build_request("POST", d.url + path, json=payload, headers=headers)
            upstream = None
            try:
                upstream = await router.client.send(request, stream=True)
                rest = upstream.aiter_raw()
                first = await _first_event(rest) if body.get("stream") and upstream.status_code == 200 else b""
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                d.in_flight -= 1
                self._down(d, exc)
                tried.add(d.name)
                continue
            except BaseException as exc:  # an error, or cancelled (the client went away)
                d.in_flight -= 1
                self.release(held)
                if upstream is not None:
                    asyncio.get_running_loop().create_task(upstream.aclose())
                if not isinstance(exc, httpx.HTTPError):
                    raise
                if isinstance(exc, httpx.TimeoutException):
                    return error_response(504, f"DECODE instance {d.name} did not answer within "
                                               f"{router.settings.request_timeout}s")
                return error_response(502, f"DECODE instance {d.name} failed: {type(exc).__name__}: {exc}")
            if first and not is_transfer_failure(first):
                def done(d: Instance = d) -> None:
                    d.in_flight -= 1
                    self.release(held)
                return Proxied(upstream, done, _chain(first, rest))
            return await self._whole(upstream, first, rest, d, held)

    async def _whole(self, upstream: httpx.Response, first: bytes, rest: AsyncIterator[bytes], d: Instance,
                     held: _Held) -> Response | _Failed:
        """D's whole answer (not streamed, an error, or a stream that is only the failure)."""
        try:
            content = first + b"".join([chunk async for chunk in rest])
        except httpx.HTTPError as exc:
            return error_response(502, f"DECODE instance {d.name} failed: {type(exc).__name__}: {exc}")
        finally:
            d.in_flight -= 1
            self.release(held)
            await upstream.aclose()
        answer = whole_answer(content, upstream.status_code, upstream.headers, raw=True)
        if (upstream.status_code == 502 or first) and is_transfer_failure(content):
            return _Failed(answer)
        return answer

    # -- helpers ---------------------------------------------------------------------------------
    def _down(self, instance: Instance, exc: Exception) -> None:
        settings = self.router.settings
        instance.down_until = time.monotonic() + max(1.0, 2 * settings.heart_beat_interval)
        logger.warning("%s instance %s unreachable (%s); trying another", instance.info.role, instance.name,
                       type(exc).__name__)

    def release(self, held: _Held) -> None:
        """Tell P to drop the request's blocks, in the background (best effort)."""
        request_id = held.params.get("remote_request_id")
        if not isinstance(request_id, str):
            return
        task = asyncio.get_running_loop().create_task(self._release(held.p, request_id, held.headers))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, p: Instance, request_id: str, headers: dict[str, str]) -> None:
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        try:
            r = await self.router.client.post(p.url + "/v1/kv_transfer/release", json={"remote_request_id": request_id},
                                              headers=auth, timeout=RELEASE_TIMEOUT_S)
            if r.status_code != 200:
                logger.warning("release of %s on %s answered %d", request_id, p.name, r.status_code)
        except httpx.HTTPError as exc:
            logger.warning("release of %s on %s failed (%s); it frees the blocks after its hold timeout",
                           request_id, p.name, type(exc).__name__)


def _p_may_still_write(prefill: Response, failed_push: bool) -> bool:
    """Whether P's error answer leaves a push of P's possibly still writing into D's reservation: then
    the reservation is left to expire (P never starts a write near its end) rather than freed now. P
    wrote nothing more when it refused the request (4xx, 503) or its push ended failing; a timeout, a
    broken connection or an engine failure (500) may leave a write under way."""
    if getattr(prefill, "p_may_still_run", False):
        return True
    return prefill.status_code >= 500 and prefill.status_code != 503 and not failed_push


def _may_still_run(response: Response) -> Response:
    """Mark an error the router made up while P may still be computing (a timeout, a broken connection)."""
    response.p_may_still_run = True  # type: ignore[attr-defined]
    return response


async def _first_event(stream: AsyncIterator[bytes]) -> bytes:
    """The bytes up to the end of the stream's first event (or all of it, when it ends before); the
    rest stays in `stream`."""
    buf = b""
    async for chunk in stream:
        buf += chunk
        if b"\n\n" in buf:
            break
    return buf


async def _chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


def _json(content: bytes) -> dict[str, Any]:
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}

