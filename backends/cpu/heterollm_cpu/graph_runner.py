"""The CPU's graph runner: eager unless `--enable_graph`. With it, decode-only steps run the model
through `torch.compile` (inductor's C++/OpenMP code): the ~1,500 small torch calls of a step fuse
into a few dozen loops between the GEMMs. One graph serves every decode batch up to the largest
size `graph_batch_sizes` asks for: the batch and context dimensions the attention metadata names
(`dynamic_dims`) and the caches' block count are compiled as symbols, not specialized on sizes 0
and 1, so a batch of one takes it too. A model whose step views a column slice by the batch size
makes dynamo guard on `n >= 2` and needs a second graph for a batch of one, which `capture`
compiles at start-up as well; llama.py's attention slices after its view so that it needs none.
Prefill and mixed steps stay eager.

The models mark a decoder layer's two halves around its attention as compile regions
(llama.py's `DecoderLayer.begin` / `finish`): dynamo traces each once and every other layer reuses
its graph with its own weights (the packed weights are graph inputs: linear.py's `PackedWeight`),
so inductor lowers and compiles one layer, not 30. Compiling SmolLM2's graph costs about 17 s on 2
cores the first time (`capture` compiles at start-up, before the engine takes requests; 45 s without
the regions, 26 s with inductor's vector-ISA probe that `inductor_options` skips; bench/RESULTS.md);
inductor caches the result on disk (TORCHINDUCTOR_CACHE_DIR), so a restart only traces the model
again. The graph is
specialized on torch's thread count: changing it afterwards compiles again (`heterollm serve` sets
its threads before the warm-up). Measured in bench/RESULTS.md (2026-12-04, 2026-12-06, 2026-12-07)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.fx.experimental._config as fx_config

from heterollm.interfaces import DecodeInputs, GraphRunner, StepForward, StepInputs
from heterollm_cpu.platform import keep_freed_memory

logger = logging.getLogger("heterollm.cpu.graph")


def inductor_options() -> dict[str, bool]:
    """Inductor's options for the compiled step. Where this CPU's kernels are built (`kernels.available`:
    g++ `-march=native` for the vector flags /proc/cpuinfo lists, part of the build's key), the compiler
    is known to emit this CPU's vector instructions, so inductor's own probe of each vector ISA (a test
    program compiled and loaded per ISA, ~9 of a 34 s cold start on 2 cores: bench/RESULTS.md, session
    21) is skipped: `cpp.vec_isa_ok` trusts the ISAs it picks from the same /proc/cpuinfo flags.
    Without the kernels inductor probes as usual."""
    from heterollm_cpu import kernels

    # no size asserts: inductor's wrapper would check every subgraph input and kernel output (~900
    # Python calls a SmolLM2 step, ~7% of a batch-1 step); dynamo's guards check the step's inputs,
    # and tests/backends/test_cpu_graph.py checks every kernel's fake against the real op
    options = {"size_asserts": False}
    if kernels.available():
        options["cpp.vec_isa_ok"] = True
    return options


# Guards dynamo may skip on the model (guard sources under `self`, the runner whose `_forward` the step
# is): that no hooks were added to a module, no attribute shadowed, no module's type changed (structure
# the engine never changes after loading), and each weight tensor's dtype, shape and strides. Weights
# change only through `--dynamic_load_weight`, which refuses a tensor that does not fit the model and
# refreshes the prepared states in place (LinearMethod.reload), so the same tensors, of the same
# metadata, stay the graph's inputs. Kept: every guard on the step's inputs (batch, positions, caches,
# metadata), on globals, and the model's plain values (ints, flags, strings). Checking the ~1,200
# skipped guards cost ~0.56 ms of a SmolLM2 batch-1 step (0.90 -> 0.34 ms in dynamo's cache lookup;
# torch.profiler, session 22), torch.compiler.skip_guard_on_all_nn_modules_unsafe 0.23 ms.
MODEL_GUARDS_SKIPPED = frozenset({"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "TYPE_MATCH",
                                  "DICT_KEYS_MATCH", "TENSOR_MATCH"})


def model_guard_filter(entries: Sequence) -> list[bool]:
    """torch.compile's `guard_filter_fn`: False for the guards `MODEL_GUARDS_SKIPPED` names on the model."""
    return [not (e.guard_type in MODEL_GUARDS_SKIPPED and not e.is_global and e.name.startswith("self."))
            for e in entries]


class CpuGraphRunner(GraphRunner):
    """Decode-only steps through torch.compile (`--enable_graph`), compiled at start-up; the rest eager."""

    @classmethod
    def validate(cls, config) -> list[str]:
        from heterollm.config.checks import attention_dp_size

        if config.execution.enable_graph and config.parallel.tp_size > 1:
            return ["--enable_graph with --tp_size > 1 is not supported on CPU yet (each rank would compile the "
                    "step on its own core, and collectives inside the compiled step are untested)"]
        if config.execution.enable_graph and attention_dp_size(config) > 1:
            return [f"--enable_graph with attention data parallelism (--dp_size={config.parallel.dp_size}) is not "
                    f"supported on CPU yet (each rank would compile the step on its own core, and the experts' "
                    f"all_to_all inside the compiled step is untested)"]
        return []

    def __init__(self) -> None:
        self.compiled: Callable[[StepInputs], torch.Tensor] | None = None
        self.max_batch = 0
        self.num_replays = 0

    def capture(self, forward: StepForward, batch_sizes: Sequence[int], make_inputs: DecodeInputs) -> None:
        """Compile `forward` and build its graph by running a decode step of 2 sequences, then one of 1
        (a replay of the same graph, or a second graph where the model's step guards on the batch
        size). `batch_sizes` is empty without `--enable_graph`: then every step runs eagerly; so does
        every step of an attention backend whose metadata names no dynamic dimensions (compiled, it
        would recompile for every new shape). Called once the weights and the KV cache are in place,
        it first has malloc keep freed memory from here on (platform.keep_freed_memory)."""
        keep_freed_memory()
        self.compiled, self.max_batch = None, 0
        if not batch_sizes or not make_inputs(1).ctx.metadata.dynamic_dims():
            return
        self.compiled = torch.compile(forward, dynamic=False,
                                      options={**inductor_options(), "guard_filter_fn": model_guard_filter})
        self.max_batch = max(batch_sizes)
        try:
            for n in sorted({min(2, self.max_batch), 1}, reverse=True):
                self._run_compiled(make_inputs(n))
        except BaseException:
            self.compiled, self.max_batch = None, 0
            raise

    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        return self.compiled is not None and is_decode_only and num_tokens <= self.max_batch

    def run(self, forward: StepForward, inputs: StepInputs) -> torch.Tensor:
        """A decode-only step that fits runs compiled, every other step eagerly. Should compiling a
        new shape fail mid-serving, the step and every later one run eagerly (with a warning)."""
        if not self.can_replay(inputs.num_tokens, inputs.ctx.metadata.decode_only):
            return forward(inputs)
        try:
            return self._run_compiled(inputs)
        except Exception as exc:
            logger.warning("compiled decode step failed (%s: %s); running eagerly from now on", type(exc).__name__, exc)
            self.compiled, self.max_batch = None, 0
            return forward(inputs)

    def _run_compiled(self, inputs: StepInputs) -> torch.Tensor:
        # the caches' block count too: it follows free memory, and a graph specialized on it would miss
        # inductor's on-disk cache on the next start
        caches = [(cache, 2) for cache in inputs.ctx.kv_caches]
        for tensor, dim in [(inputs.input_ids, 0), (inputs.positions, 0), *inputs.ctx.metadata.dynamic_dims(), *caches]:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        # no duck sizing or 0/1 specialization: one context block or no fresh block takes the same graph
        with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
            out = self.compiled(inputs)
        self.num_replays += 1
        return out
