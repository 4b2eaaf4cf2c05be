"""model_executor/kv_moves.py: the tensor-parallel ranks agree on which PD moves ended. A move is over
only once it ended on every rank (a rank still moving may still write into its blocks), failed when
it failed on any rank (with this rank's reason, or the other rank's named); a synchronous connector's
moves end in the step that started them. The other rank is simulated by the all-reduce."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from heterollm.interfaces.kv_connector import KVConnector
from heterollm.model_executor.kv_moves import KVMoves


class Conn(KVConnector):
    asynchronous = True

    def __init__(self):
        self.ended: dict[str, str | None] = {}

    @classmethod
    def validate(cls, config):
        return []

    def poll(self, wait_for=()):
        out, self.ended = self.ended, {}
        return out

    def save(self, pairs):
        pass

    def load(self, pairs):
        pass


class Sync(Conn):
    asynchronous = False


class OtherRank:
    """all_reduce adds the other rank's flags: [ended per move..., failed per move...]."""

    def __init__(self):
        self.flags: list[float] = []
        self.calls = 0

    def all_reduce(self, t):
        self.calls += 1
        return t + torch.tensor(self.flags, dtype=t.dtype)


def moves(tp=2, sync=False):
    comm = OtherRank()
    conn = Sync() if sync else Conn()
    return KVMoves({"t": conn}, SimpleNamespace(tp_size=tp, communicator=comm), torch.device("cpu")), conn, comm


def test_a_move_is_over_only_when_every_rank_ended_it():
    m, conn, other = moves()
    m.started(conn, ["a", "b"], {}, "pull")
    other.flags = [1, 0, 0, 0]  # the other rank: a ended, b moving
    assert m.poll() is None, "nothing ended here yet"
    conn.ended = {"a": None, "b": None}
    other.flags = [1, 0, 0, 0]
    assert m.poll() == {"a": None}, "b still moves on the other rank"
    other.flags = [1, 0]  # b alone is left
    assert m.poll() == {"b": None} and m.poll() is None and other.calls == 3


def test_a_failure_on_any_rank_fails_the_move_on_every_rank():
    m, conn, other = moves()
    m.started(conn, ["a", "b", "c"], {"c": "refused at once"}, "push")
    conn.ended = {"a": None, "b": "reading timed out", "zzz": None}  # zzz: not a move of this rank's
    other.flags = [1, 1, 1, 1, 0, 0]  # the other rank: all ended, a failed there
    assert m.poll() == {"a": "another tensor-parallel rank could not push its share of the KV blocks",
                        "b": "reading timed out", "c": "refused at once"}
    assert not m.state


def test_a_synchronous_connectors_moves_end_in_their_step_and_one_rank_needs_no_all_reduce():
    m, conn, other = moves(tp=1, sync=True)
    assert m.poll() is None
    m.started(conn, ["a", "b"], {"b": "dead peer"}, "pull")
    assert m.poll() == {"a": None, "b": "dead peer"} and other.calls == 0
