"""What an instance tells the service layer about itself, and where it is kept.

The layout follows xLLM's XServiceClient (jd-opensource/xllm, xllm/core/distributed_runtime/
xservice_client.cpp, and xllm-service's xllm_rpc_service.proto): an instance is the etcd key
`XLLM:<ROLE>:<name>` (ROLE one of DEFAULT, PREFILL, DECODE, MIX; name its HTTP `host:port`) under a
lease of --etcd_ttl seconds, and its value is a JSON object with InstanceMetaInfo's field names
(`name`, `type` as the InstanceType number, `dp_size`, `incarnation_id`, `register_ts_ms`). Where
xLLM sends load only in heartbeats (LoadMetrics: waiting_requests_num, gpu_cache_usage_perc), this
value carries it too, rewritten each --heart_beat_interval, so a router reading etcd alone sees it.
Ours in addition: `role`, `http_address`, `model`, `block_size`, `load_metrics.running_requests_num`.
--etcd_namespace, when set, prefixes every key with `<namespace>/`.
"""
from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field

def advertised_host(host: str) -> str:
    """The address other hosts reach this one at: `host`, or this host's own for a wildcard."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


ROLES = ("DEFAULT", "PREFILL", "DECODE", "MIX")
"""xLLM's InstanceType, in its proto's order (the number is the `type` field)."""
KEY_PREFIX = "XLLM:"


@dataclass
class Load:
    """An instance's load, as its engine replicas report it (summed over --dp_size replicas)."""

    running_requests_num: int = 0
    waiting_requests_num: int = 0
    gpu_cache_usage_perc: float = 0.0
    """Fraction of KV cache blocks in use, 0..1 (the mean over replicas); xLLM's name, any device."""


@dataclass
class InstanceInfo:
    name: str
    """The instance's HTTP `host:port`, as xLLM names instances."""
    role: str = "DEFAULT"
    model: str = ""
    """The served model name (what /v1/models lists)."""
    dp_size: int = 1
    block_size: int = 0
    incarnation_id: str = ""
    """New at each start, so the service layer tells a restarted instance from the old one."""
    register_ts_ms: int = 0
    load_metrics: Load = field(default_factory=Load)

    @property
    def http_address(self) -> str:
        return f"http://{self.name}"

    def to_json(self) -> str:
        body = asdict(self)
        body.update(type=ROLES.index(self.role), http_address=self.http_address)
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> InstanceInfo:
        """Raises ValueError (json.JSONDecodeError, KeyError as ValueError) for a value that is not one."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ValueError("not an instance record: no `name`")
        role = data.get("role")
        if role not in ROLES:
            number = data.get("type", 0)
            role = ROLES[number] if isinstance(number, int) and 0 <= number < len(ROLES) else "DEFAULT"
        load = data.get("load_metrics") or {}
        return cls(name=data["name"], role=role, model=str(data.get("model", "")),
                   dp_size=int(data.get("dp_size", 1) or 1), block_size=int(data.get("block_size", 0) or 0),
                   incarnation_id=str(data.get("incarnation_id", "")),
                   register_ts_ms=int(data.get("register_ts_ms", 0) or 0), load_metrics=parse_load(load))


def parse_load(data: dict) -> Load:
    return Load(running_requests_num=int(data.get("running_requests_num", 0) or 0),
                waiting_requests_num=int(data.get("waiting_requests_num", 0) or 0),
                gpu_cache_usage_perc=float(data.get("gpu_cache_usage_perc", 0.0) or 0.0))


def namespace_prefix(namespace: str) -> str:
    return f"{namespace}/" if namespace else ""


def instance_key(namespace: str, role: str, name: str) -> str:
    """`[<namespace>/]XLLM:<ROLE>:<host:port>`."""
    return f"{namespace_prefix(namespace)}{KEY_PREFIX}{role}:{name}"


def instances_prefix(namespace: str) -> str:
    """The prefix every instance key of `namespace` starts with (any role)."""
    return f"{namespace_prefix(namespace)}{KEY_PREFIX}"


def is_instance_key(key: str, namespace: str) -> bool:
    """`key` names an instance (XLLM:SERVICE:* are xllm-service's own keys, not instances)."""
    rest = key[len(instances_prefix(namespace)):]
    return key.startswith(instances_prefix(namespace)) and rest.split(":", 1)[0] in ROLES
