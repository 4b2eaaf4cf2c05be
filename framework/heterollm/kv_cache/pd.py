"""Prefill/decode disaggregation: an instance's role, its launch checks, and the "mooncake_transfer"
KV connector that moves a request's prompt blocks between a PREFILL and a DECODE instance.

Both instances run the same --kv_cache_transfer_mode. The router drives the flow (service/disagg.py;
README "Disaggregated serving").

PULL (the DECODE instance reads):
1. The PREFILL instance runs the prompt with max_tokens 1 for a request carrying
   `kv_transfer_params: {"do_remote_decode": true}`, samples the first token and keeps the request's
   blocks (`Scheduler.held`) until released or HOLD_TIMEOUT_S passes. Its answer carries
   `kv_transfer_params` (`prefill_result`): its ranks' transfer endpoints and cache addresses, the
   block ids, the prompt's token ids and the first token.
2. The DECODE instance admits the request with those params: the blocks its prefix cache lacks are
   allocated, the first token is its first output, and each rank pulls the blocks over Mooncake's
   transfer engine (TCP), head by head (the two instances may have different tensor-parallel sizes),
   on its transfer threads: the request waits for its K/V (`Scheduler.transferring`) while the
   engine steps on with the others, and decodes once the pull ended on every rank. A pull that
   fails ends that request with an error; the other requests go on.
3. The router then releases the PREFILL instance's blocks.

PUSH (the PREFILL instance writes; xLLM's default):
1. The DECODE instance reserves blocks for the prompt (`{"do_remote_prefill": true, "reserve": true}`:
   the client's request, tokenized as for generation, answered at once). Its prefix cache's blocks
   are shared; the rest are allocated and wait, held by the reservation (`Scheduler.reserved`), for
   the prefill instance's K/V, or for HOLD_TIMEOUT_S. The answer's `kv_transfer_params` name its
   ranks, the reservation and the blocks to write.
2. The PREFILL instance runs the prompt with those params; in the forward that completes the prompt,
   each rank starts writing its share of the blocks into the reserved ones on its transfer threads,
   PUSH_GROUPS groups of layers each as soon as the forward is past them, the last after it (head by
   head, to the decode ranks that hold those heads; --kv_push_dst_rotate starts each rank at a
   different one), and the engine steps on. Its answer (the first token, the
   reservation), sent once the writes ended on every rank, is the signal that the K/V is in place;
   the request's blocks are kept until then. A push that failed is a 502 kv_transfer_failed, and the
   reservation expires.
3. The DECODE instance admits the request with that answer: it takes over the reservation's blocks
   and decodes from the first token on; nothing is transferred in its step.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
import time
import queue
import threading
from collections.abc import Collection
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

import torch

from heterollm.config import ConfigError
from heterollm.interfaces.kv_connector import KVConnector, KVPull, KVPush, KVTransfers, PeerRank
from heterollm.service.instance import advertised_host

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig
    from heterollm.model_executor.runner import LaunchContext

logger = logging.getLogger("heterollm.kv_cache.pd")

HOLD_TIMEOUT_S = 120.0
"""How long a PREFILL instance keeps a finished request's blocks for its DECODE instance to pull, and a
DECODE instance a reservation for its PREFILL instance to push into (PUSH)."""


def move_margin() -> float:
    """The hold a move must have left to start: Mooncake's own transfer timeout (MC_TRANSFER_TIMEOUT,
    30 s by default, 5 s at least), so a transfer that hangs has given up before the peer frees the
    blocks it reads or writes, plus 5 s for the instances' wall clocks to differ (keep them in sync,
    e.g. NTP)."""
    try:
        timeout = max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        timeout = 30
    return timeout + 5.0
PUSH_GROUPS = 4
"""PUSH: a prompt's layers go in this many groups of consecutive layers, each pushed while the forward
computes the next ones (the last after the forward)."""
PUSH_WAIT_S = 0.25
"""How long the step that pushed waits at its end for its pushes' last writes (the layers after the
last group handed over): an answer whose push ended then goes out with this step, not after the next
one (a long prefill, maybe). A push still running then is seen to end by a later step."""
TRANSFER_THREADS = 4
"""Moves a rank runs at once (each its own request's, all its peer ranks one after another): a peer that
does not answer holds one thread until the transport's timeout, the others go on."""
ROLES = ("DEFAULT", "MIX", "PREFILL", "DECODE")
_SPLITWISE = {"mixed": None, "prefill": "PREFILL", "decode": "DECODE"}


def pd_role(config: HeterollmConfig) -> str:
    """The instance's role: --instance_role, or FastDeploy's --splitwise_role prefill / decode."""
    return _SPLITWISE[config.fastdeploy.splitwise_role] or config.pd.instance_role


def is_disaggregated(config: HeterollmConfig) -> bool:
    return pd_role(config) in ("PREFILL", "DECODE")


def pd_problems(config: HeterollmConfig) -> list[str]:
    """The PD flags' launch checks, one line each naming the flag."""
    pd, fd = config.pd, config.fastdeploy
    out = []
    sw = _SPLITWISE[fd.splitwise_role]
    if sw and pd.instance_role not in ("DEFAULT", sw):
        out.append(f"--splitwise_role={fd.splitwise_role} contradicts --instance_role={pd.instance_role}")
    role = pd_role(config)
    defaults = type(pd)()
    if pd.disagg_pd_port != defaults.disagg_pd_port:
        out.append("--disagg_pd_port: heterollm's instances exchange PD control over their HTTP API port (the "
                   "router calls /v1/kv_transfer/release there); there is no separate bRPC server to place")
    if fd.innode_prefill_ports:
        out.append("--innode_prefill_ports: FastDeploy's in-node prefill engine ports; heterollm's PREFILL "
                   "instances are reached through the router (heterollm route --prefill_instances / etcd)")
    if role not in ("PREFILL", "DECODE"):
        if pd.enable_disagg_pd:
            out.append("--enable_disagg_pd=true: needs --instance_role PREFILL or DECODE (or --splitwise_role prefill "
                       "/ decode)")
        for name in ("kv_cache_transfer_mode", "transfer_listen_port", "kv_push_dst_rotate"):
            if getattr(pd, name) != getattr(defaults, name):
                out.append(f"--{name}: only a PREFILL or DECODE instance transfers KV (--instance_role)")
        return out
    if pd.kv_push_dst_rotate and pd.kv_cache_transfer_mode != "PUSH":
        out.append(f"--kv_push_dst_rotate=true: rotates the decode ranks a PREFILL instance pushes to; with "
                   f"--kv_cache_transfer_mode={pd.kv_cache_transfer_mode} nothing is pushed")
    elif pd.kv_push_dst_rotate and role != "PREFILL":
        out.append(f"--kv_push_dst_rotate=true: rotates the decode ranks a PREFILL instance pushes to; a "
                   f"{role} instance pushes nothing")
    from heterollm.config.checks import attention_dp_size

    if attention_dp_size(config) > 1:
        out.append(f"--instance_role={role}: not built with attention data parallelism")
    if config.speculative.draft_model:
        out.append(f"--instance_role={role}: a draft model's KV cache is not transferred: not served with "
                   "--draft_model")
    if config.distributed.nnodes > 1:
        out.append(f"--instance_role={role}: one node per instance (--nnodes > 1 is not built for PD)")
    return out


class MooncakeTransferConnector(KVConnector):
    """The core's "mooncake_transfer" connector: a Mooncake transfer engine per rank over TCP (its
    listening port --transfer_listen_port + rank), with the rank's cache tensors registered so a
    peer can read them. Pulls read each (layer, K/V, head) block slice of the peer's cache, mapping
    heads across different tensor-parallel sizes."""

    @classmethod
    def validate(cls, config: HeterollmConfig) -> list[str]:
        return []  # pd_problems runs with every launch's flag checks (config/checks.py)

    def __init__(self, launch: LaunchContext, caches: list[torch.Tensor], block_dim: int, num_slots: int) -> None:
        if not caches or block_dim != 2 or caches[0].dim() != 5 or caches[0].shape[0] != 2:
            shape = tuple(caches[0].shape) if caches else ()
            raise ConfigError(f"--instance_role: PD disaggregation moves caches laid out (K/V, heads, blocks, "
                              f"block size, head dim); this model's cache is {shape} (MLA caches are not built)")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ConfigError(f"--instance_role: Mooncake's transfer engine is not installed ({exc}); "
                              "pip install 'heterollm[kv]' (mooncake-transfer-engine-non-cuda)") from None
        config = launch.config
        self.caches = caches
        if caches[0].device.type != "cpu":  # a device's kernels may not have run when the forward's
            self.push_groups = 0  # Python is past a layer (no event recorded here): push after the step
        self.rank, self.tp = launch.rank, config.parallel.tp_size
        self.rotate = config.pd.kv_push_dst_rotate
        host = advertised_host(config.server.host)
        port = config.pd.transfer_listen_port + self.rank
        self.engine = TransferEngine()
        if self.engine.initialize(f"{host}:{port}", "P2PHANDSHAKE", "tcp", "") != 0:
            raise ConfigError(f"--transfer_listen_port={config.pd.transfer_listen_port}: the transfer engine of rank "
                              f"{self.rank} did not start on {host}:{port}")
        for cache in caches:
            if self.engine.register_memory(cache.data_ptr(), cache.numel() * cache.element_size()) != 0:
                raise ConfigError("--instance_role: the transfer engine could not register the KV cache's memory")
        self.addr = f"{host}:{self.engine.get_rpc_port()}"
        self.threads = _DaemonThreads(TRANSFER_THREADS, f"heterollm-kv-transfer-{self.rank}")
        self.moving: dict[str, _Moving] = {}
        """request id -> its move, running on the transfer threads."""
        logger.info("KV transfer: rank %d listens on %s", self.rank, self.addr)

    def info(self) -> dict[str, Any]:
        c = self.caches[0]
        return {"addr": self.addr, "ptrs": [t.data_ptr() for t in self.caches], "shape": list(c.shape),
                "dtype": str(c.dtype)}

    def save(self, pairs: list[tuple[int, int]]) -> None:
        raise NotImplementedError("the transfer connector only pulls and pushes between instances")

    def load(self, pairs: list[tuple[int, int]]) -> None:
        raise NotImplementedError("the transfer connector only pulls and pushes between instances")

    asynchronous = True

    def apply(self, transfers: KVTransfers) -> dict[str, str]:
        self._start(transfers.pulls, "pull")
        return {}

    def after_forward(self, transfers: KVTransfers) -> dict[str, str]:
        self._start(transfers.pushes, "push")
        return {}

    push_groups = PUSH_GROUPS

    def push_layers(self, pushes: list[KVPush], layers: range) -> None:
        entries = [self.moving.setdefault(move.request_id, _Moving("push")) for move in pushes]  # all known first
        for move, entry in zip(pushes, entries):
            entry.futures.append(self.threads.submit(self._move, move, True, layers))
            entry.layers = layers.stop

    def _start(self, moves: list[KVPull] | list[KVPush], kind: str) -> None:
        """Each move runs on the transfer threads (Mooncake's calls release the GIL) while the engine
        steps on: a slow or dead peer holds up only its own requests, for the transport's timeout. A
        push's layers not handed over during the forward (`push_layers`) go now."""
        for move in moves:
            entry = self.moving.setdefault(move.request_id, _Moving(kind))
            if entry.layers < len(self.caches):
                entry.futures.append(self.threads.submit(self._move, move, kind == "push",
                                                         range(entry.layers, len(self.caches))))
            entry.sealed = True

    def poll(self, wait_for: Collection[str] = ()) -> dict[str, str | None]:
        """Waits up to PUSH_WAIT_S for the step's pushes first. (Called after a step's forward and
        after_forward: a move not sealed then is one whose step failed part way, with some of its layers
        handed over; it ends as failed once those did.)"""
        waiting = [f for rid in wait_for if rid in self.moving for f in self.moving[rid].futures]
        if waiting:
            wait(waiting, timeout=PUSH_WAIT_S)
        ended = {}
        for rid, entry in list(self.moving.items()):
            if not all(future.done() for future in entry.futures):
                continue
            del self.moving[rid]
            why = None if entry.sealed else "the step failed before every layer was handed over"
            for future in entry.futures if why is None else ():  # the first group's failure, in layer order
                try:
                    why = future.result()
                except Exception as exc:  # a bug or a transport error the move did not name; or cancelled
                    why = f"{type(exc).__name__}: {exc}"
                if why is not None:
                    break
            if why is not None:
                logger.warning("KV %s for %s failed: %s", entry.kind, rid, why)
            ended[rid] = why
        return ended

    def _move(self, move: KVPull | KVPush, push: bool, layers: range) -> str | None:
        """Check the peer's hold, then move these layers' blocks (the move must end within the hold, else
        what moved is not trusted)."""
        hold = "the decode instance's reservation" if push else "the prefill instance's hold on the blocks"
        if time.time() > move.expires_at - move_margin():
            return (f"{hold} runs out in less than {move_margin():.0f} s (held {HOLD_TIMEOUT_S:.0f} s): its "
                    f"blocks may be another request's before the transfer ends, nothing is " +
                    ("written" if push else "read"))
        why = self._copy(move, push, layers)
        if why is None and time.time() > move.expires_at:
            return (f"the transfer ended after {hold} ran out: " +
                    ("the decode instance may have given the blocks to another request" if push else
                     "the prefill instance may have given the blocks to another request; what was read is dropped"))
        return why

    def _copy(self, move: KVPull | KVPush, push: bool, layers: range) -> str | None:
        """Copy the move's blocks of these layers between this rank's cache and the peer ranks that hold
        the same KV heads: read them (a pull) or write them (a push), one batch per peer rank."""
        mine = self.caches[0]
        _, heads, blocks, bs, dim = mine.shape
        elt = mine.element_size()
        peers = move.peers
        peer_heads = peers[0].shape[1]
        other = "decode" if push else "prefill"
        if len(self.caches) != len(peers[0].ptrs) or tuple(peers[0].shape[3:]) != (bs, dim) \
                or peers[0].dtype != str(mine.dtype) or peer_heads * len(peers) != heads * self.tp:
            return (f"the {other} instance's cache ({len(peers)} rank(s) of {tuple(peers[0].shape)} {peers[0].dtype}, "
                    f"{len(peers[0].ptrs)} layers) does not match this one's ({self.tp} rank(s) of {tuple(mine.shape)} "
                    f"{mine.dtype}, {len(self.caches)} layers): same model, dtype and block size needed")
        chunk = bs * dim * elt
        spans = block_runs(move.remote_blocks, move.local_blocks)
        by_peer: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for layer in layers:
            base = self.caches[layer].data_ptr()
            for kv in range(2):
                for j in range(heads):
                    g = self.rank * heads + j  # the global KV head
                    peer_rank, h = divmod(g, peer_heads)
                    peer = peers[peer_rank]
                    peer_blocks = peer.shape[2]
                    local, remote, lens = by_peer.setdefault(peer_rank, ([], [], []))
                    for rb, lb, n in spans:  # a run of consecutive blocks on both sides is one slice
                        remote.append(peer.ptrs[layer] + ((kv * peer_heads + h) * peer_blocks + rb) * chunk)
                        local.append(base + ((kv * heads + j) * blocks + lb) * chunk)
                        lens.append(n * chunk)
        for peer_rank in peer_order(sorted(by_peer), self.rank, push and self.rotate):
            local, remote, lens = by_peer[peer_rank]
            addr = peers[peer_rank].addr
            verb = "writing to" if push else "reading from"
            try:
                if push:
                    rc = self.engine.batch_transfer_sync_write(addr, local, remote, lens)
                else:
                    rc = self.engine.batch_transfer_sync_read(addr, local, remote, lens)
            except Exception as exc:  # the transport's own errors
                return f"{verb} the {other} instance's rank {peer_rank} ({addr}) failed: {exc}"
            if rc != 0:
                return (f"{verb} the {other} instance's rank {peer_rank} ({addr}) failed "
                        f"(transfer engine code {rc}): is it still running?")
        return None

    def close(self) -> None:
        if getattr(self, "threads", None) is not None:
            self.threads.shutdown()  # the moves not started are cancelled; running ones are not waited for
            self.threads = None
        if any(not f.done() for entry in getattr(self, "moving", {}).values() for f in entry.futures):
            logger.warning("KV transfer: rank %d closes with transfers still running (a peer that does not "
                           "answer); its cache stays registered until the process ends", self.rank)
            self.caches = []
        if self.caches:
            for cache in self.caches:
                try:
                    self.engine.unregister_memory(cache.data_ptr())
                except Exception:
                    pass
        self.caches = []


@dataclass
class _Moving:
    """A request's move on this rank: one transfer per group of layers handed over so far."""

    kind: str
    futures: list[Future] = field(default_factory=list)
    layers: int = 0
    """The layers handed over so far (0 ..)."""
    sealed: bool = False
    """Every layer is handed over (after the forward): the move ends when its transfers have."""


class _DaemonThreads:
    """A fixed set of daemon threads running submitted calls in order: a transfer to a peer that never
    answers blocks its thread, but never the process's exit (a ThreadPoolExecutor's threads are joined
    then)."""

    def __init__(self, count: int, name: str) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.count = count
        for i in range(count):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self.jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Cancel the calls not started, and let each thread end after its current one."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(self.count):
            self.jobs.put(None)


def block_runs(remote: tuple[int, ...], local: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(remote block, local block, count) runs of block pairs consecutive on both sides, in order:
    each run is one contiguous slice per (layer, K/V, head) of either cache."""
    runs: list[list[int]] = []
    for rb, lb in zip(remote, local):
        if runs and rb == runs[-1][0] + runs[-1][2] and lb == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([rb, lb, 1])
    return [(rb, lb, n) for rb, lb, n in runs]


def peer_order(peer_ranks: list[int], rank: int, rotate: bool) -> list[int]:
    """The order in which a rank visits the peer ranks it sends to: ascending, or, with
    --kv_push_dst_rotate, starting at the one its own rank number points at (rank mod their count), so
    the prefill ranks of a TP group do not all write to the decode instance's rank 0 first."""
    if not rotate or not peer_ranks:
        return list(peer_ranks)
    k = rank % len(peer_ranks)
    return list(peer_ranks[k:]) + list(peer_ranks[:k])


def peers_from(params: dict[str, Any]) -> tuple[PeerRank, ...]:
    """The PeerRanks a prefill instance's kv_transfer_params describe (raises ValueError naming what is wrong)."""
    ranks = params.get("remote_ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("remote_ranks must be a non-empty list")
    out = []
    for i, r in enumerate(ranks):
        try:
            out.append(PeerRank(addr=str(r["addr"]), ptrs=tuple(int(p) for p in r["ptrs"]),
                                shape=tuple(int(x) for x in r["shape"]), dtype=str(r["dtype"])))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"remote_ranks[{i}] needs addr, ptrs, shape and dtype") from None
        if len(out[-1].shape) != 5:
            raise ValueError(f"remote_ranks[{i}].shape must have 5 dimensions")
    return tuple(out)
