"""A tensor-parallel worker process: one rank of the model.

Every rank builds the backend's own (in-process) executor for its shard, joined to the others
through the platform's Communicator. Rank 0 takes calls from the engine over a pipe and forwards
each one to the other ranks with a broadcast on a gloo group (a pickled object: on 2 CPU cores a
64-request decode batch costs ~0.3 ms); every rank runs the call, and rank 0 answers. Ranks on
other nodes (`--nnodes`, `--node_rank`) run the same loop without a pipe.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from heterollm import envs

if TYPE_CHECKING:
    import torch

    from heterollm.interfaces import Platform

logger = logging.getLogger("heterollm.worker")

STOP = "stop"


def init_method(config: Any, port: int | None = None) -> str:
    """The rendezvous: --master_node_addr across nodes, a free loopback port on one node."""
    if config.distributed.nnodes > 1 or port is None:
        return f"tcp://{config.distributed.master_node_addr}"
    return f"tcp://127.0.0.1:{port}"


def wait_for_master(address: str, attempts: int, world_size: int) -> None:
    """Ranks other than 0 first reach rank 0's store, retrying `attempts` times (--max_reconnect_count)."""
    import torch.distributed as dist

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    for attempt in range(1, attempts + 1):
        try:
            dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timedelta(seconds=3))
            return
        except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
            if attempt == attempts:
                raise ConnectionError(f"could not reach the master node at {host}:{port} after {attempts} attempts "
                                      f"(--max_reconnect_count); last error: {exc}") from None
            time.sleep(0.5)


def local_rank(config: Any, rank: int) -> int:
    """This rank's index among its node's ranks: LOCAL_RANK when a launcher (torchrun) set it, else
    its position in the node's share of the ranks (see executor.local_ranks)."""
    from heterollm.config.checks import world_size

    from_launcher = envs.local_rank()
    if from_launcher is not None:
        return from_launcher
    return rank % (world_size(config) // config.distributed.nnodes)


def _bind(platform: Platform, config: Any, rank: int) -> None:
    """Bind this process to its device, then seed it as the engine seeds its own process: every
    rank draws the same random numbers, so --random_seed makes sampled text repeatable."""
    platform.set_device(local_rank(config, rank))
    if config.execution.random_seed >= 0:
        platform.seed(config.execution.random_seed)


def collective_device(platform: Platform) -> torch.device | None:
    """The device this rank's collectives run on (the one `set_device` bound), for
    `init_process_group(device_id=...)`; None on a platform whose tensors live on the host."""
    import torch

    if platform.device_type == "cpu":
        return None
    index = torch.get_device_module(platform.device_type).current_device()
    return torch.device(platform.device_type, index)


def worker_main(config: Any, rank: int, world_size: int, address: str, max_model_len: int, local_ranks: int,
                conn: Any = None) -> None:
    """The process entry point (spawned). `conn` is the engine's pipe on rank 0, else None."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        executor, ctrl = _build(config, rank, world_size, address, max_model_len, local_ranks)
    except BaseException as exc:  # report why this rank could not start, then leave
        logger.error("rank %d failed to start: %s", rank, exc)
        if conn is not None:
            conn.send((None, RuntimeError(f"tensor-parallel rank {rank} failed to start: {exc}")))
        raise SystemExit(1) from None
    if conn is not None:
        conn.send(("ready", None))
    from heterollm.config.checks import attention_dp_size

    _serve(executor, ctrl, rank, conn, gather_steps=attention_dp_size(config) > 1)


def _build(config: Any, rank: int, world_size: int, address: str, max_model_len: int,
           local_ranks: int) -> tuple[Any, Any]:
    import torch.distributed as dist

    from heterollm.plugins.launch import launch_selection
    from heterollm.model_executor.loader import resolve_model
    from heterollm.model_executor.runner import LaunchContext

    source = resolve_model(config.model.model, config.fastdeploy.revision)
    selection = launch_selection(config, lambda: source.architectures)
    selection.platform.configure_threads(local_ranks)  # the node's ranks share its host cores
    _bind(selection.platform, config, rank)
    if rank != 0:
        wait_for_master(address, config.server.max_reconnect_count, world_size)
    communicator = selection.component("communicators")(rank, world_size, address,
                                                        device=collective_device(selection.platform))
    ctrl = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    launch = LaunchContext(config, selection, source, max_model_len,
                           rank=rank, world_size=world_size, communicator=communicator)
    return selection.component("executors")(launch), ctrl


def merge_outputs(outputs: list[Any]) -> Any:
    """Attention DP: one step's RunnerOutput from the ranks' own (each covers its requests). Timings
    are the slowest rank's; EPLB's counters, each rank's choices, are summed."""
    from heterollm.interfaces import RunnerOutput

    merged = RunnerOutput([], [], [], [])
    pooled = any(o.pooled is not None for o in outputs)
    merged.pooled = [] if pooled else None
    for o in outputs:
        merged.request_ids += o.request_ids
        merged.sampled_token_ids += o.sampled_token_ids
        merged.logprobs += o.logprobs
        merged.prompt_logprobs += o.prompt_logprobs
        if pooled:
            merged.pooled += o.pooled if o.pooled is not None else [None] * len(o.request_ids)
        for key, seconds in o.timings.items():
            merged.timings[key] = max(merged.timings.get(key, 0.0), seconds)
    loads = [o.expert_load for o in outputs if o.expert_load is not None]
    if loads:
        merged.expert_load = dict(loads[0])
        for key in ("expert", "replica", "rank_window"):
            merged.expert_load[key] = [[sum(v) for v in zip(*rows)] for rows in zip(*(load[key] for load in loads))]
    return merged


def _serve(executor: Any, ctrl: Any, rank: int, conn: Any, gather_steps: bool = False) -> None:
    """`gather_steps` (attention DP): each rank ran its own requests; rank 0 answers with them all."""
    import torch.distributed as dist

    while True:
        box = [conn.recv() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        method, args = box[0]
        if method == STOP:
            break
        result, error = None, None
        try:
            result = getattr(executor, method)(*args)
        except Exception as exc:
            logger.exception("rank %d: %s failed", rank, method)
            if rank != 0:  # nobody hears this rank's answer: leave, so the engine sees a dead worker
                os._exit(1)
            error = exc
        if method in ("memory_profile", "stop_profile", "kv_connector_info"):  # rank 0 answers for every rank (the launcher
            # sizes the cache for all; every rank's trace file)
            profiles: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(profiles, result if error is None else [], group=ctrl)
            result = [p for rank_profiles in profiles for p in rank_profiles]
        elif method == "execute" and gather_steps:
            outputs: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(outputs, result, group=ctrl)
            result = merge_outputs(outputs) if rank == 0 and error is None else None
        if rank == 0:
            conn.send((result, error))
    executor.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
