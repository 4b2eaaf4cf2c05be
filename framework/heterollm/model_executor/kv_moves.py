"""The PD moves a rank started (pulls into its cache, pushes out of it) until they ended on every rank.

Every rank is given the same moves in the same steps (`KVTransfers.pulls` / `.pushes`), so every rank
holds the same request ids here in the same order. Each step, after polling its connectors, a rank
says of each of them whether its share ended and whether it failed; one all-reduce over those flags
makes the ranks agree: a move is over when it ended on every rank (its blocks are then neither read
nor written by any transfer), and failed when it failed on any.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from heterollm.interfaces.kv_connector import KVConnector, KVTransfers
    from heterollm.model_executor.parallel import ParallelContext

_MOVING = object()
_WHAT = {"pull": "pull its share of the KV blocks", "push": "push its share of the KV blocks"}


class KVMoves:
    def __init__(self, connectors: dict[str, KVConnector], pctx: ParallelContext, device: torch.device) -> None:
        self.connectors = connectors
        self.pctx = pctx
        self.device = device
        self.state: dict[str, list] = {}
        """request id -> [kind ("pull" / "push"), _MOVING, or None (arrived) or why it failed on this rank]."""

    def started(self, conn: KVConnector, request_ids: list[str], failed: dict[str, str], kind: str) -> None:
        """`conn` was given these requests' moves; `failed` those that failed at once. A synchronous
        connector's moves have all ended."""
        for rid in request_ids:
            self.state[rid] = [kind, failed[rid] if rid in failed else (_MOVING if conn.asynchronous else None)]

    def not_started(self, transfers: dict[str, KVTransfers], handed: set[str]) -> None:
        """After a step: its pulls and pushes that never started (the step failed first) end as failed,
        reported by the next poll (their requests wait for that to free their blocks); the pushes of
        the connectors in `handed`, which got some of their layers before the step failed, are moving
        until those connectors report them (failed)."""
        for name, moves in transfers.items():
            for kind, started in (("pull", moves.pulls), ("push", moves.pushes)):
                for move in started:
                    if move.request_id not in self.state:
                        partly = kind == "push" and name in handed
                        self.state[move.request_id] = [kind, _MOVING if partly else
                                                       "the step failed before this move started"]

    def poll(self, wait_for: Collection[str] = ()) -> dict[str, str | None] | None:
        """The moves that ended on every rank since the last call: request id -> None, or why it failed
        (`wait_for`: the step's pushes, which a connector may wait for briefly)."""
        if not self.state:
            return None
        for conn in self.connectors.values():
            if conn.asynchronous:
                for rid, why in conn.poll(wait_for).items():
                    entry = self.state.get(rid)
                    if entry is not None and entry[1] is _MOVING:
                        entry[1] = why
        ids = list(self.state)
        ended = [0.0 if self.state[r][1] is _MOVING else 1.0 for r in ids]
        failed = [1.0 if isinstance(self.state[r][1], str) else 0.0 for r in ids]
        tp = self.pctx.tp_size
        if tp > 1:
            flags = self.pctx.communicator.all_reduce(torch.tensor(ended + failed, device=self.device)).tolist()
            ended, failed = flags[:len(ids)], flags[len(ids):]
        done: dict[str, str | None] = {}
        for rid, e, f in zip(ids, ended, failed):
            if e < tp - 0.5:  # still moving on some rank: its blocks stay out of reach
                continue
            kind, why = self.state.pop(rid)
            if why is None and f > 0.5:
                why = f"another tensor-parallel rank could not {_WHAT[kind]}"
            done[rid] = why
        return done or None
