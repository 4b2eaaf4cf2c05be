"""`--layers_wise_copy_batchs N`: a step's host-tier loads (blocks copied back into the cache before
the forward reads them) split into N groups of consecutive layers. The first group is copied before
the forward starts; a thread copies the others while it runs, and a layer's attention waits for its
group only when it gets there (`WaitingCaches`, the step's `ForwardContext.kv_caches`). On a device
backend the thread's copies overlap the first layers' compute; 0 or 1 copies every layer first.

PD PUSH goes the other way (`PushingCaches`): a group of layers is pushed as soon as the forward is
past it, while the forward computes the next ones.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from heterollm.interfaces.kv_connector import KVConnector


def layer_groups(num_layers: int, batches: int) -> list[range]:
    """`num_layers` split into min(batches, num_layers) runs of consecutive layers, the first ones one
    longer when it does not divide."""
    n = max(1, min(batches, num_layers))
    size, extra = divmod(num_layers, n)
    out, start = [], 0
    for g in range(n):
        end = start + size + (g < extra)
        out.append(range(start, end))
        start = end
    return out


class LayerwiseLoad:
    """One connector's loads of one step, group by group (`KVConnector.load_layers`)."""

    def __init__(self, connector: KVConnector, pairs: list[tuple[int, int]], num_layers: int, batches: int) -> None:
        """batches <= 1 (or one layer): every layer now, no thread."""
        self.groups = layer_groups(num_layers, batches)
        self.group_of = [g for g, layers in enumerate(self.groups) for _ in layers]
        self.ready = [threading.Event() for _ in self.groups]
        self.error: BaseException | None = None
        self._connector, self._pairs = connector, pairs
        t0 = time.perf_counter()
        connector.load_layers(pairs, self.groups[0])
        self.seconds = time.perf_counter() - t0
        """Seconds spent copying, over every group (the thread's included once joined)."""
        self.estimate = self.seconds * num_layers / max(len(self.groups[0]), 1)
        """What copying every layer takes, from the first group's copy alone (the thread's own timings
        include waiting for the cores the forward holds)."""
        self.ready[0].set()
        if len(self.groups) == 1:
            self._thread = None
            return
        self._thread = threading.Thread(target=self._copy_rest, name="heterollm-layerwise-load", daemon=True)
        self._thread.start()

    def _copy_rest(self) -> None:
        import torch

        try:
            with torch.inference_mode():  # thread-local: the caches are inference tensors
                for g in range(1, len(self.groups)):
                    t0 = time.perf_counter()
                    self._connector.load_layers(self._pairs, self.groups[g])
                    self.seconds += time.perf_counter() - t0
                    self.ready[g].set()
        except BaseException as exc:  # raised to the forward by wait / join
            self.error = exc
            for event in self.ready:
                event.set()

    def wait(self, layer: int) -> None:
        self.ready[self.group_of[layer]].wait()
        if self.error is not None:
            raise RuntimeError(f"copying the host KV tier's blocks back failed: {self.error}") from self.error

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"copying the host KV tier's blocks back failed: {self.error}") from self.error


class PushingCaches(list):
    """The per-layer caches as a forward that completes prompts to push reads them: when it reads layer
    l, every layer before l has written this step's K/V, so each group of layers it is past is handed
    to `ready` then (the layers after the last group handed over are pushed after the forward).
    `caches` may be a `WaitingCaches`: reading goes through it."""

    def __init__(self, caches: list[torch.Tensor], groups: list[range], ready: Callable[[range], None]) -> None:
        super().__init__(list.__getitem__(caches, slice(None)))  # no iteration: a WaitingCaches would wait
        self.inner, self.groups, self.ready = caches, groups, ready
        self.next = 0

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, int) and index >= 0:  # (layer -1 says nothing of the layers before it)
            layer = index
            while self.next < len(self.groups) and self.groups[self.next].stop <= layer:
                self.next += 1  # counted first: a hand-over that raised part way may have started
                self.ready(self.groups[self.next - 1])
        return self.inner[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.inner)


class WaitingCaches(list):
    """The per-layer caches, as the forward reads them: indexing layer l waits for l's group of every
    load; iterating (a graph runner walking all layers) waits for every group."""

    def __init__(self, caches: list[torch.Tensor], loads: list[LayerwiseLoad]) -> None:
        super().__init__(caches)
        self.loads = loads

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, int):
            layer = index % len(self)
            for load in self.loads:
                load.wait(layer)
        else:
            for load in self.loads:
                load.join()
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for load in self.loads:
            load.join()
        return super().__iter__()
