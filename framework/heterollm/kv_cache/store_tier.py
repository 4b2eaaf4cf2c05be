"""The KV cache store (`--enable_kvcache_store`): prefix-cache blocks shared across instances through
Mooncake's distributed store (`mooncake_master` plus a metadata server; TCP transport).

Every full block the prefix cache registers is put in the store once its K/V is computed, under a
key naming the model's layout, the prefix hash and the tensor-parallel rank (each rank puts its own
heads' share). A request whose prefix chain runs past the device pool and the host tier is looked up
in the store: the engine fetches the blocks it finds (`--prefetch_batch_size` blocks per request to
the store, no new batch after `--prefetch_timeout` ms), gives the request fresh blocks and has the
next step copy the bytes in. A block whose fetch fails is a cache miss, never a half-loaded block.

Puts run on the ranks (they hold the data), before the forward of the step after the one that
computed the block; a block that stopped naming its prefix since (evicted, rewritten) is skipped.
"""
from __future__ import annotations

import logging
import socket
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from heterollm.config import ConfigError
from heterollm.interfaces.kv_connector import KVConnector, KVTransfers

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig
    from heterollm.model_executor.runner import LaunchContext

logger = logging.getLogger("heterollm.kv_cache.store")

SEGMENT_BYTES = 512 << 20
"""Memory each instance mounts into the store (its share of the store's capacity)."""
BUFFER_BYTES = 64 << 20
"""Each client's local transfer buffer."""
_CLIENTS: dict[tuple, Any] = {}
"""One store client per process and address (an in-process rank shares the engine's)."""


def store_problems(config: HeterollmConfig) -> list[str]:
    """Why the store cannot serve this config (empty: it can, or it is off). Cheap: no network."""
    st = config.kv_cache_store
    if not st.enable_kvcache_store:
        return []
    out = []
    if not config.kv_cache.enable_prefix_cache:
        out.append("--enable_kvcache_store: the store keeps prefix-cache blocks (by hash): it needs "
                   "--enable_prefix_cache")
    if not st.store_master_server_address:
        out.append("--enable_kvcache_store: needs --store_master_server_address HOST:PORT (mooncake_master's RPC "
                   "address)")
    elif st.store_master_server_address.startswith("etcd://"):
        out.append(f"--store_master_server_address={st.store_master_server_address}: the highly available master "
                   "(etcd://) is not built; give the one master's HOST:PORT")
    if not st.store_metadata_server:
        out.append("--enable_kvcache_store: needs --store_metadata_server (an http://HOST:PORT/metadata URL, e.g. "
                   "mooncake_master's own with --enable_http_metadata_server, or P2PHANDSHAKE)")
    if st.store_protocol == "rdma":
        devices = _rdma_devices()
        if not devices:
            out.append("--store_protocol=rdma: this machine has no RDMA device (/sys/class/infiniband is empty); "
                       "use --store_protocol=tcp")
        elif st.store_rdma_devices:
            missing = [d for d in st.store_rdma_devices.split(",") if d and d not in devices]
            if missing:
                out.append(f"--store_rdma_devices={st.store_rdma_devices}: no such RDMA device {', '.join(missing)} "
                           f"(present: {', '.join(devices)})")
    elif st.store_rdma_devices:
        out.append("--store_rdma_devices: only read with --store_protocol=rdma")
    from heterollm.config.checks import attention_dp_size

    if attention_dp_size(config) > 1:
        out.append("--enable_kvcache_store: not built for attention data parallelism (each DP rank keeps its "
                   "own pool)")
    if config.speculative.draft_model:
        out.append("--enable_kvcache_store: a draft model keeps its own KV cache, which the store does not hold: "
                   "not served with --draft_model")
    return out


def _rdma_devices() -> list[str]:
    try:
        import os

        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--store_master_server_address={address}: expected HOST:PORT")
    return host, int(port)


def probe_store(config: HeterollmConfig, timeout: float = 3.0) -> None:
    """Fail fast, naming the flag, when the master or the metadata server does not answer (Mooncake's
    own client retries for about 90 s before giving up)."""
    st = config.kv_cache_store
    host, port = _hostport(st.store_master_server_address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"--store_master_server_address={st.store_master_server_address}: mooncake_master does "
                          f"not answer ({exc})") from None
    url = st.store_metadata_server
    if url.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(url, timeout=timeout).close()
        except urllib.error.HTTPError:
            pass  # it answered (a metadata server says 4xx to a bare GET)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--store_metadata_server={url}: the metadata server does not answer ({exc})") from None


def open_store(config: HeterollmConfig, segment_bytes: int) -> Any:
    """This process's store client (set up once per address)."""
    st = config.kv_cache_store
    key = (st.store_master_server_address, st.store_metadata_server, st.store_protocol)
    client = _CLIENTS.get(key)
    if client is not None:
        return client
    probe_store(config)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError(f"--enable_kvcache_store: Mooncake's store is not installed ({exc}); "
                          "pip install 'heterollm[kv]' (mooncake-transfer-engine-non-cuda)") from None
    client = MooncakeDistributedStore()
    rc = client.setup(st.store_local_hostname or "127.0.0.1", st.store_metadata_server, segment_bytes, BUFFER_BYTES,
                      st.store_protocol, st.store_rdma_devices, st.store_master_server_address)
    if rc != 0:
        raise ConfigError(f"--enable_kvcache_store: the Mooncake store client did not start (code {rc}) with "
                          f"--store_master_server_address={st.store_master_server_address} "
                          f"--store_metadata_server={st.store_metadata_server}")
    _CLIENTS[key] = client
    return client


def close_store(config: HeterollmConfig) -> None:
    """Close this process's client (its mounted memory leaves the store, and its blocks with it)."""
    st = config.kv_cache_store
    client = _CLIENTS.pop((st.store_master_server_address, st.store_metadata_server, st.store_protocol), None)
    if client is not None:
        try:
            client.close()
        except Exception as exc:  # closing is best effort: the process may be ending anyway
            logger.warning("closing the KV store client: %s", exc)


def key_prefix(config: HeterollmConfig, hf_config: Any) -> str:
    """What a key names besides the prefix hash and the rank: the model (its config), the block size,
    the dtypes, the tensor-parallel size and the hash seed. Instances share a block only when all agree."""
    layout = "|".join(str(x) for x in (hf_config.to_json_string(use_diff=False), config.kv_cache.block_size,
                                       config.device.dtype, config.kv_cache.kv_cache_dtype, config.parallel.tp_size,
                                       config.kv_cache.xxh3_128bits_seed))
    return f"heterollm/{xxhash.xxh64_hexdigest(layout.encode())}"


def block_key(prefix: str, block_hash: int, rank: int) -> str:
    return f"{prefix}/{block_hash:032x}/{rank}"


class StoreTier:
    """Engine side: which committed blocks still need a put, and fetching a request's blocks."""

    def __init__(self, client: Any, prefix: str, ranks: int, batch_size: int, timeout_ms: int) -> None:
        self.client, self.prefix, self.ranks = client, prefix, ranks
        self.batch_size = max(1, batch_size)
        self.timeout_ms = timeout_ms
        self._fresh: list[tuple[int, int, int]] = []
        """(block, hash, generation) registered since the last step was built: computed by that step."""
        self._ready: list[tuple[int, int, int]] = []
        """Registered before it: computed once the step in flight is done, put before the next forward."""
        self.put = 0
        """Blocks handed to the ranks to put."""
        self.fetched = 0
        """Blocks fetched from the store for a request."""
        self.failed = 0
        """Lookups that found a block but could not fetch it (a miss)."""

    def fit_batches(self, share_bytes: int) -> None:
        """Keep one get_batch (a batch of blocks, every rank's share of each, `share_bytes` apiece)
        within half the client's transfer buffer: Mooncake answers a larger one partly empty."""
        self.batch_size = max(1, min(self.batch_size, (BUFFER_BYTES // 2) // max(1, share_bytes * self.ranks)))

    def committed(self, block: int, block_hash: int, generation: int) -> None:
        self._fresh.append((block, block_hash, generation))

    def fetch(self, hashes: list[int]) -> tuple[list[int], dict[int, list[bytes]]]:
        """The leading `hashes` the store holds for every rank, with their bytes."""
        found: list[int] = []
        data: dict[int, list[bytes]] = {}
        if not hashes:
            return found, data
        started = time.monotonic()
        for i in range(0, len(hashes), self.batch_size):
            if i and self.timeout_ms and (time.monotonic() - started) * 1000 >= self.timeout_ms:
                break
            chunk = hashes[i:i + self.batch_size]
            keys = [block_key(self.prefix, h, r) for h in chunk for r in range(self.ranks)]
            try:
                values = self.client.get_batch(keys)
            except Exception as exc:  # the store is an optimization: a failure is a miss
                logger.warning("KV store fetch failed: %s", exc)
                self.failed += 1
                break
            for j, h in enumerate(chunk):
                shares = values[j * self.ranks:(j + 1) * self.ranks]
                if not all(shares):
                    return found, data
                found.append(h)
                data[h] = list(shares)
                self.fetched += 1
        return found, data

    def take_puts(self, still_named: Any) -> list[tuple[int, int]]:
        """(block, hash) to put before the next forward: those registered before the last build whose
        block still names the same prefix (`still_named(block, hash, generation)`)."""
        ready, self._ready, self._fresh = self._ready, self._fresh, []
        out = [(b, h) for b, h, g in ready if still_named(b, h, g)]
        self.put += len(out)
        return out


class MooncakeStoreConnector(KVConnector):
    """The core's "mooncake_store" connector: a rank puts its share of a block (every layer's slice,
    as one contiguous byte string) under its own key, and copies fetched bytes back in."""

    @classmethod
    def validate(cls, config: HeterollmConfig) -> list[str]:
        return store_problems(config)

    def __init__(self, launch: LaunchContext, caches: list[torch.Tensor], block_dim: int, num_slots: int) -> None:
        self.caches, self.block_dim = caches, block_dim
        self.rank = launch.rank
        self.prefix = key_prefix(launch.config, launch.source.hf_config)
        # rank 0 of an in-process engine shares the engine's client; a worker process mounts no memory
        self.client = open_store(launch.config, SEGMENT_BYTES if launch.world_size == 1 else 0)
        self.puts_failed = 0
        self._block_bytes = sum(c.numel() // c.shape[block_dim] for c in caches) * caches[0].element_size()

    def _block(self, block: int) -> torch.Tensor:
        return torch.stack([c.select(self.block_dim, block) for c in self.caches])

    def save(self, pairs: list[tuple[int, int]]) -> None:
        # batches of at most half the client's transfer buffer: Mooncake refuses a larger put_batch whole
        per_batch = max(1, (BUFFER_BYTES // 2) // max(1, self._block_bytes))
        for i in range(0, len(pairs), per_batch):
            keys, values = [], []
            for block, block_hash in pairs[i:i + per_batch]:
                keys.append(block_key(self.prefix, block_hash, self.rank))
                values.append(self._block(block).contiguous().cpu().view(torch.uint8).numpy().tobytes())
            try:
                code = self.client.put_batch(keys, values)
            except Exception as exc:  # a block not in the store is a later miss, nothing worse
                code = exc
            if code not in (0, None):
                self.puts_failed += len(keys)
                logger.warning("KV store: putting %d blocks failed (%s); they will be misses", len(keys), code)

    def load(self, pairs: list[tuple[int, int]], data: dict[int, list[bytes]] | None = None) -> None:
        like = self._block(0)
        for block_hash, block in pairs:
            raw = data[block_hash][self.rank]
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            shares = flat.view(like.dtype).view(like.shape)
            for layer, cache in enumerate(self.caches):
                cache.select(self.block_dim, block).copy_(shares[layer].to(cache.device))

    def apply(self, transfers: KVTransfers) -> dict[str, str]:
        if transfers.save:
            self.save(transfers.save)
        if transfers.load:
            self.load(transfers.load, transfers.data)
        return {}  # a load's bytes were fetched before the step: nothing here can fail a request

    def close(self) -> None:
        self.caches = []
