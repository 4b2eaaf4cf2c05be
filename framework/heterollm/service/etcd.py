"""A small etcd v3 client over etcd's JSON gateway (`/v3/kv/*`, `/v3/lease/*`; keys and values are
base64 in the JSON), with httpx: what registration and discovery need, and no gRPC dependency.

Every call has a timeout and raises `EtcdUnavailable` when etcd cannot be reached or answers with
an error, so callers decide whether that is a launch error or a line in the log."""
from __future__ import annotations

import base64
import json

import httpx


class EtcdUnavailable(Exception):
    """etcd did not answer, or answered with an error."""


class LeaseNotFound(EtcdUnavailable):
    """The lease expired or was revoked: its keys are gone."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def prefix_end(prefix: str) -> str:
    """The `range_end` that makes a range request cover every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # prefixes here are printable ASCII, never 0xff
    return base64.b64encode(bytes(raw)).decode()


class EtcdClient:
    """One etcd endpoint, `host:port` (http:// is added when no scheme is given)."""

    def __init__(self, address: str, timeout: float = 2.0) -> None:
        self.address = address
        base = address if "://" in address else f"http://{address}"
        self._http = httpx.Client(base_url=base.rstrip("/"), timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict) -> dict:
        try:
            response = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EtcdUnavailable(f"etcd at {self.address}: {type(exc).__name__}: {exc}") from None
        try:
            data = response.json()
        except json.JSONDecodeError:
            raise EtcdUnavailable(f"etcd at {self.address}: HTTP {response.status_code}, not JSON") from None
        if "error" in data or response.status_code != 200:
            message = data.get("message") or data.get("error") or f"HTTP {response.status_code}"
            kind = LeaseNotFound if "lease not found" in message else EtcdUnavailable
            raise kind(f"etcd at {self.address}: {message}")
        return data

    def health(self) -> None:
        """Raises EtcdUnavailable unless etcd answers that it is healthy."""
        try:
            response = self._http.get("/health")
            healthy = response.status_code == 200 and response.json().get("health") == "true"
        except (httpx.HTTPError, json.JSONDecodeError, AttributeError) as exc:
            raise EtcdUnavailable(f"etcd at {self.address}: {type(exc).__name__}: {exc}") from None
        if not healthy:
            raise EtcdUnavailable(f"etcd at {self.address} is not healthy (GET /health: {response.text[:200]})")

    def grant(self, ttl: int) -> str:
        """A new lease of `ttl` seconds; its id (a decimal string, as the gateway writes int64)."""
        return self._post("/v3/lease/grant", {"TTL": ttl})["ID"]

    def keepalive(self, lease: str) -> int:
        """Renew `lease`; its remaining TTL. Raises LeaseNotFound when it expired or was revoked."""
        result = self._post("/v3/lease/keepalive", {"ID": lease}).get("result", {})
        ttl = int(result.get("TTL", 0))
        if ttl <= 0:  # the gateway answers a gone lease with no TTL rather than an error
            raise LeaseNotFound(f"etcd at {self.address}: lease {lease} not found")
        return ttl

    def revoke(self, lease: str) -> None:
        """End `lease` now; etcd deletes its keys."""
        self._post("/v3/lease/revoke", {"ID": lease})

    def put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        self._post("/v3/kv/put", body)

    def get(self, key: str) -> str | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, str]:
        """Every key starting with `prefix`, with its value."""
        data = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": prefix_end(prefix)})
        return {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in data.get("kvs", [])}

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key)})
