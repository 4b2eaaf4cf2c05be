"""The multi-process Executor for tensor parallelism (`--tp_size N`): one spawned worker process per
local rank, each running the selected backend's executor on its shard (distributed/worker.py).

The scheduler stays in the engine process; each call goes to rank 0 over a pipe, rank 0 forwards it
to the other ranks, and only rank 0 answers. While it waits, the executor watches every local
worker (`--health_check_interval_ms`): a worker that dies fails the call with ExecutorDead naming
the rank and its exit code, and the other workers are stopped, so nothing hangs on a collective.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from multiprocessing.connection import wait
from typing import Any

from heterollm.config.checks import attention_dp_size, world_size
from heterollm.distributed.worker import STOP, init_method, worker_main
from heterollm.interfaces import Executor, RunnerOutput, SchedulerOutput
from heterollm.interfaces.executor import ExecutorDead, RankMemory

logger = logging.getLogger("heterollm.distributed")

SETUP = (None, "load_model", "memory_profile", "initialize_cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(config: Any) -> range:
    """The ranks this node runs: world_size / nnodes consecutive ones (tp_size, times the attention
    data-parallel size)."""
    per_node = world_size(config) // config.distributed.nnodes
    return range(config.distributed.node_rank * per_node, (config.distributed.node_rank + 1) * per_node)


def spawn_workers(config: Any, max_model_len: int, address: str, conn_for_rank0: Any = None) -> list[Any]:
    ctx = mp.get_context("spawn")
    ranks = local_ranks(config)
    procs = []
    for rank in ranks:
        conn = conn_for_rank0 if rank == 0 else None
        p = ctx.Process(target=worker_main, name=f"heterollm-tp{rank}", daemon=True,
                        args=(config, rank, world_size(config), address, max_model_len, len(ranks), conn))
        p.start()
        procs.append(p)
    return procs


class MultiprocExecutor(Executor):

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def __init__(self, launch: Any) -> None:
        cfg = launch.config
        self.interval = cfg.server.health_check_interval_ms / 1000
        self.ranks = local_ranks(cfg)
        address = init_method(cfg, free_port())
        self.conn, child = mp.get_context("spawn").Pipe()
        self.procs = spawn_workers(cfg, launch.max_model_len, address, child)
        child.close()
        self.dead: str | None = None
        self._closed = False
        logger.info("%s: %d ranks (%d on this node), rendezvous %s",
                    "attention data parallel" if attention_dp_size(cfg) > 1 else "tensor parallel", world_size(cfg),
                    len(self.ranks), address)
        self._call(None)  # wait until every local rank has built its executor (or one failed)

    # -- the pipe --------------------------------------------------------------------------
    def _call(self, method: str | None, *args: Any) -> Any:
        if self.dead:
            raise ExecutorDead(self.dead)
        if method is not None:
            self.conn.send((method, args))
        sentinels = {p.sentinel: (rank, p) for rank, p in zip(self.ranks, self.procs)}
        while True:
            ready = wait([self.conn, *sentinels], timeout=self.interval)
            if self.conn in ready:
                try:
                    result, error = self.conn.recv()
                except EOFError:
                    pass  # rank 0 is gone: its sentinel says how
                else:
                    if error is not None:
                        if method in SETUP:  # a rank that cannot load leaves nothing to run: stop them all
                            self.shutdown()
                        raise error
                    return result
            gone = [(rank, p) for rank, p in sentinels.values() if not p.is_alive()]
            if gone:
                rank, p = gone[0]
                self._fail(f"tensor-parallel worker rank {rank} died (exit code {p.exitcode})")

    def _fail(self, why: str) -> None:
        self.dead = why
        logger.error("%s; stopping the other workers", why)
        self._stop_all(grace=0.0)
        raise ExecutorDead(why)

    def check_health(self) -> None:
        """Raise ExecutorDead when a local worker has died (the engine calls it between steps)."""
        for rank, p in zip(self.ranks, self.procs):
            if not p.is_alive() and not self._closed:
                self._fail(f"tensor-parallel worker rank {rank} died (exit code {p.exitcode})")

    # -- the contract ----------------------------------------------------------------------
    def load_model(self) -> None:
        self._call("load_model")

    def memory_profile(self) -> list[RankMemory]:
        """Every rank's profile (rank 0 gathers them), in rank order."""
        return self._call("memory_profile")

    def initialize_cache(self, num_blocks: int, host_blocks: int = 0) -> None:
        self._call("initialize_cache", num_blocks, host_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self._call("execute", scheduler_output)

    def update_weights(self, update: Any) -> int:
        """Every rank loads its shard of the new weights (a rank that fails leaves the job)."""
        return self._call("update_weights", update)

    def kv_connector_info(self) -> list[dict[str, dict[str, object]]]:
        """Every rank's (rank 0 gathers them), in rank order."""
        return self._call("kv_connector_info")

    def start_profile(self) -> None:
        self._call("start_profile")

    def stop_profile(self) -> list[str]:
        """Every rank's trace files (rank 0 gathers them)."""
        return self._call("stop_profile")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.dead:
            try:
                self.conn.send((STOP, ()))
            except OSError:
                pass
        self._stop_all(grace=10.0)

    def _stop_all(self, grace: float) -> None:
        for p in self.procs:
            p.join(grace)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.conn.close()


def run_node_workers(config: Any) -> int:
    """`--node_rank K` (K > 0) of a multi-node job: run this node's ranks until node 0's engine
    stops them. Returns the exit status (0 when every rank ended cleanly)."""
    from heterollm.plugins.launch import launch_selection
    from heterollm.model_executor.loader import resolve_model
    from heterollm.model_executor.runner import model_max_len

    launch_selection(config)  # the same checks node 0 runs, before anything starts
    max_len = model_max_len(config, resolve_model(config.model.model, config.fastdeploy.revision).hf_config)
    address = init_method(config)
    procs = spawn_workers(config, max_len, address)
    ranks = local_ranks(config)
    logger.info("node %d of %d: ranks %d-%d joining %s", config.distributed.node_rank, config.distributed.nnodes,
                ranks[0], ranks[-1], address)
    status = 0
    for rank, p in zip(ranks, procs):
        p.join()
        if p.exitcode:
            logger.error("rank %d exited with status %s", rank, p.exitcode)
            status = 1
    return status
