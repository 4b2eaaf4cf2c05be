"""Block pool and per-request block tables.

A request owning `n` tokens of KV holds ceil(n / block_size) blocks. `allocate` grows a table
to cover the tokens scheduled this step or refuses (the scheduler then preempts); `free` returns
all of a request's blocks; `trim` gives back tail blocks (speculative decoding's rejected tokens).
"""
from __future__ import annotations


class BlockPool:
    """Free blocks as a stack: the most recently freed blocks are handed out first. A cache that
    is reserved but committed page by page (the CPU backend's) then keeps its resident memory at
    the working set; a FIFO pool would walk every block of the reservation over time (measured:
    +180 MiB of server RSS per round of 32 requests, without end)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 on top

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        have = len(self.tables.get(request_id, ()))
        return self.blocks_for(num_tokens) - have <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make the request's table cover `num_tokens` tokens; None (nothing changed) if short."""
        table = self.tables.setdefault(request_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.pool.num_free:
            if not table:
                del self.tables[request_id]
            return None
        if need > 0:
            table.extend(self.pool.take(need))
        return table

    def trim(self, request_id: str, num_tokens: int) -> None:
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        if keep < len(table):
            self.pool.give_back(table[keep:])
            del table[keep:]

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.give_back(table)
