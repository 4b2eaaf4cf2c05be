"""Expert-parallel load balancing (EPLB, `--enable_eplb`): where each sparse layer's experts live, how
much each one is asked for, and the periodic re-placement that replicates hot experts.

Each of the `ep` ranks has `E / ep + R` expert slots (`R` = `--redundant_experts_num`), so `ep * R`
slots hold a second (third, ...) replica of some expert. `phys2log[p]` is the logical expert in
physical slot p (slot p % S of rank p // S). A token's choice of expert e goes to one of e's
replicas in turn: the n-th choice of e since start to replica n mod replicas(e) (so the replicas
of a hot expert share its tokens evenly, step after step, and every rank picks the same one). Replicas hold the same weights, so the output
does not depend on the choice.

Every `--eplb_update_interval` steps the placement is re-planned from the load counted since the
last one: each redundant slot goes, one at a time, to the expert with the highest load per replica;
the replicas are then packed onto the ranks heaviest first, each onto the least-loaded rank with a
free slot (a slot that already holds the expert is kept where possible, so few weights move). Rank
0's plan is broadcast, and each slot whose expert changed receives the weights from a rank that held
that expert (its own rank first) through the Communicator's all_to_all, between two steps."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Move:
    """Physical slot `dst` receives the weights of physical slot `src` (the same logical expert)."""

    dst: int
    src: int


class ExpertPlacement:
    def __init__(self, num_experts: int, ep: int, redundant: int) -> None:
        if num_experts % ep:
            raise ValueError(f"--ep_size={ep} does not divide the {num_experts} routed experts")
        self.num_experts, self.ep, self.redundant = num_experts, ep, redundant
        self.slots = num_experts // ep + redundant
        """Expert slots per rank."""
        own = num_experts // ep
        # rank r first holds its own experts, then replicas of the next ranks' first experts
        self.phys2log = torch.tensor([r * own + i if i < own else ((r + 1) * own + i - own) % num_experts
                                      for r in range(ep) for i in range(self.slots)], dtype=torch.long)
        self.window = torch.zeros(num_experts, dtype=torch.long)
        """Choices per logical expert since the last re-placement (what the next plan balances)."""
        self.total = torch.zeros(num_experts, dtype=torch.long)
        """Choices per logical expert since start (/metrics)."""
        self.replica_total = torch.zeros(ep * self.slots, dtype=torch.long)
        """Choices each physical slot served since start (/metrics: the redundant replicas' share)."""
        self.replica_window = torch.zeros(ep * self.slots, dtype=torch.long)
        """Choices each physical slot served since the last re-placement."""
        self.counting = True
        """False while a forward that is not traffic runs (attention DP's idle-rank token)."""
        self.rebalances = 0
        self._index()

    def _index(self) -> None:
        counts = torch.bincount(self.phys2log, minlength=self.num_experts)
        self.replicas = counts
        """Replicas of each logical expert."""
        order = torch.argsort(self.phys2log, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        self._by_expert, self._starts = order, starts
        """Physical slots grouped by logical expert: expert e's are _by_expert[_starts[e] : + replicas[e]]."""

    def local_slots(self, rank: int, expert: int) -> list[int]:
        """This rank's slots holding logical `expert`."""
        row = self.phys2log[rank * self.slots:(rank + 1) * self.slots]
        return (row == expert).nonzero().flatten().tolist()

    def to_physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Each choice (tokens, k) of a logical expert -> a physical slot holding it, and count both."""
        flat = ids.reshape(-1).cpu()
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(flat, stable=True)
        nth = torch.empty_like(flat)  # the choice's rank among the expert's choices so far
        nth[order] = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        nth += self.total[flat]
        phys = self._by_expert[self._starts[flat] + nth % self.replicas[flat]]
        if not self.counting:
            return phys.view(ids.shape).to(ids.device)
        self.window += counts
        self.total += counts
        served = torch.bincount(phys, minlength=self.ep * self.slots)
        self.replica_window += served
        self.replica_total += served
        return phys.view(ids.shape).to(ids.device)

    def rank_load(self) -> torch.Tensor:
        """Choices each rank served since the last re-placement, (ep,)."""
        return self.replica_window.view(self.ep, self.slots).sum(1)

    def plan(self, window: torch.Tensor | None = None) -> torch.Tensor:
        """The next phys2log from the window's load (deterministic: every rank computes the same);
        `window`: the load to balance instead of this rank's count (attention DP: every rank's sum)."""
        load = (self.window if window is None else window).double()
        replicas = torch.ones(self.num_experts, dtype=torch.long)
        for _ in range(self.ep * self.redundant):  # argmax: the lowest id among equals
            replicas[int(torch.argmax(load / replicas))] += 1
        items = sorted(((float(load[e] / replicas[e]), e) for e in range(self.num_experts)
                        for _ in range(int(replicas[e]))), key=lambda t: (-t[0], t[1]))
        held = [set(self.phys2log[r * self.slots:(r + 1) * self.slots].tolist()) for r in range(self.ep)]
        assigned: list[list[int]] = [[] for _ in range(self.ep)]
        totals = [0.0] * self.ep
        for weight, e in items:
            open_ranks = [r for r in range(self.ep) if len(assigned[r]) < self.slots and e not in assigned[r]]
            if not open_ranks:  # every rank with room already holds e
                open_ranks = [r for r in range(self.ep) if len(assigned[r]) < self.slots]
            # the least-loaded rank; among equals, one that already holds e (nothing to move)
            r = min(open_ranks, key=lambda r: (totals[r], e not in held[r], r))
            assigned[r].append(e)
            totals[r] += weight
        new = []
        for r in range(self.ep):  # keep each expert in a slot that already holds it
            old = self.phys2log[r * self.slots:(r + 1) * self.slots].tolist()
            todo = list(assigned[r])
            row: list[int | None] = []
            for e in old:
                if e in todo:
                    todo.remove(e)
                    row.append(e)
                else:
                    row.append(None)
            new.extend(x if x is not None else todo.pop(0) for x in row)
        return torch.tensor(new, dtype=torch.long)

    def moves(self, new: torch.Tensor) -> list[Move]:
        """The slots whose expert changes, each with a source slot that holds it now (on the same rank
        when one does, else the lowest)."""
        out = []
        for dst in (new != self.phys2log).nonzero().flatten().tolist():
            e = int(new[dst])
            holders = (self.phys2log == e).nonzero().flatten().tolist()
            rank = dst // self.slots
            same = [p for p in holders if p // self.slots == rank]
            out.append(Move(dst, (same or holders)[0]))
        return out

    def commit(self, new: torch.Tensor) -> None:
        self.phys2log = new.clone()
        self.window.zero_()
        self.replica_window.zero_()
        self.rebalances += 1
        self._index()
