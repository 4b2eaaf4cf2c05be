"""The CPU backend's C++ kernels, built from source on the machine that runs them.

    python -m heterollm_cpu.kernels        # build (scripts/setup.sh runs this), then say where

`csrc/paged_decode.cpp` becomes `torch.ops.heterollm_cpu.paged_decode`, and `csrc/fused_ops.cpp`
the fused `rms_norm`, `silu_and_mul` and `rotary_embedding` (fused.py puts them in the op registry),
and `csrc/int8_linear.cpp` the W8A8 linear of `--quantization w8a8`, `csrc/int4_linear.cpp` the 4-bit
weight-only linear of `--quantization wint4` (linear.py), `csrc/int8_gemm.cpp` the int8-weight GEMM of
`wint8` (and of `w8a8` on CPUs without int8 dot products), `csrc/int8_dot_gemm.cpp` `w8a8`'s GEMM on CPUs
with AVX512-VNNI, `csrc/int4_dot_linear.cpp` `wint4`'s on CPUs with AVX512-VNNI, `csrc/bf16_linear.cpp` the unquantized bf16
linear on CPUs with AVX512_BF16, `csrc/kv_store.cpp` the paged cache's store
(`store_kv`, attention.py),
through torch.utils.cpp_extension (g++, `-O3 -march=native -ffast-math`: the build targets this CPU's vector units, exp from glibc's
libmvec).
The library goes to `_build/<hash>/` next to this file (or under the user's cache when the package
folder is read-only), where the hash covers the source, torch's version, the flags and the CPU's
vector extensions: an edited source, another torch or another CPU is never served a stale library.
Nothing is ever downloaded, and nothing is built at serving time: without a built library
`available()` is False, attention.py runs its torch path and the registry keeps the torch ops (the
same numbers, slower), after one log line saying how to build it.
HETEROLLM_CPU_KERNELS=0 turns the kernels off (benchmarks' A/B, a suspected kernel bug).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger("heterollm.cpu")

NAME = "heterollm_cpu_kernels"
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "paged_prefill.cpp",
                                                                 "fused_ops.cpp", "int8_linear.cpp",
                                                                 "int4_linear.cpp", "kv_store.cpp",
                                                                 "int8_gemm.cpp", "int8_dot_gemm.cpp",
                                                                 "int4_dot_linear.cpp", "bf16_linear.cpp",
                                                                 "argmax_rows.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp", "-lmvec"]
_loaded: bool | None = None


HEADERS = [Path(__file__).parent / "csrc" / name for name in ("bf16_dot.h", "scalar_types.h",
                                                                 "quantize_rows.h")]


def _key() -> str:
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    # -march=native means this CPU's instructions: a library built on an AVX-512 machine dies of SIGILL
    # on an AVX2-only one sharing the folder (a copied venv, an image built elsewhere)
    h.update(" ".join(vector_features()).encode())
    return h.hexdigest()[:16]


def vector_features() -> list[str]:
    """The CPU's vector-instruction flags from /proc/cpuinfo (what `-march=native` compiles for)."""
    from heterollm_cpu.platform import _cpu_flags

    return sorted(f for f in _cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c", "sse", "ssse", "bmi",
                                                           "asimd", "sve")))


def build_dirs() -> list[Path]:
    """Where the library may be, in the order looked at: the package's own folder, the user's cache."""
    key = _key()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "heterollm" / "cpu-kernels"
    return [Path(__file__).parent / "_build" / key, cache / key]


def library_path() -> Path | None:
    for folder in build_dirs():
        path = folder / f"{NAME}.so"
        if path.exists():
            return path
    return None


def enabled() -> bool:
    return os.environ.get("HETEROLLM_CPU_KERNELS", "1") != "0"


def available() -> bool:
    """Whether the kernels (`torch.ops.heterollm_cpu.paged_decode`, ...) run here (loads the built
    library once)."""
    global _loaded
    if _loaded is None:
        _loaded = False
        path = library_path()
        if not enabled():
            logger.info("CPU kernels off (HETEROLLM_CPU_KERNELS=0): attention and the fused ops run their torch path")
        elif path is None:
            logger.info("CPU kernels not built for this source and torch %s: attention and the fused ops run "
                        "their torch path "
                        "(build them with `python -m heterollm_cpu.kernels`, as scripts/setup.sh does)",
                        torch.__version__)
        else:
            if not hasattr(torch.ops.heterollm_cpu, "paged_decode"):  # loaded once per process
                torch.ops.load_library(str(path))
                _register_fake()
            _loaded = True
    return _loaded


def _register_fake() -> None:
    """The ops' shape rules, for torch.compile (the CPU graph runner traces through attention)."""
    @torch.library.register_fake("heterollm_cpu::paged_decode")
    def _(query, kv_cache, block_tables, seq_lens, scale):
        return torch.empty_like(query)

    @torch.library.register_fake("heterollm_cpu::paged_prefill")
    def _(query, kv_cache, starts, ctx_lens, q_lens, block_tables, scale, out):
        return None

    @torch.library.register_fake("heterollm_cpu::rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("heterollm_cpu::silu_and_mul")
    def _(gate, up):
        return gate.new_empty(gate.shape)

    @torch.library.register_fake("heterollm_cpu::rotary_embedding")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("heterollm_cpu::w8a8_linear")
    def _(x, codes, w_scale, bias):
        return x.new_empty(*x.shape[:-1], codes.shape[0])

    @torch.library.register_fake("heterollm_cpu::store_kv")
    def _(kv_cache, fresh_blocks, slots, key, value):
        return None

    @torch.library.register_fake("heterollm_cpu::int8_gemm")
    def _(x, panels, w_scale, qmax, bias):
        return x.new_empty(*x.shape[:-1], w_scale.shape[0])

    @torch.library.register_fake("heterollm_cpu::int8_dot_gemm")
    def _(x, panels, w_scale, w_sums, bias):
        return x.new_empty(*x.shape[:-1], w_scale.shape[0])

    @torch.library.register_fake("heterollm_cpu::int4_linear")
    def _(x, panels, scales, mins, group, n, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("heterollm_cpu::int4_dot_linear")
    def _(x, panels, scales, mins, group, n, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("heterollm_cpu::bf16_linear")
    def _(x, panels, n, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("heterollm_cpu::argmax_rows")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.long)


def build(verbose: bool = False) -> Path:
    """Compile the kernels into the first writable build folder; returns the library's path."""
    from torch.utils.cpp_extension import load

    existing = library_path()
    if existing is not None:
        return existing
    errors = []
    for folder in build_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".writable"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
             build_directory=str(folder), is_python_module=False, verbose=verbose)
        for stale in folder.parent.iterdir():  # builds of earlier sources or another torch
            if stale.is_dir() and stale != folder:
                shutil.rmtree(stale, ignore_errors=True)
        return folder / f"{NAME}.so"
    raise OSError("no writable folder for the CPU kernels: " + "; ".join(errors))


if __name__ == "__main__":
    try:
        print(f"heterollm CPU kernels: {build(verbose='-v' in sys.argv)}")
    except Exception as exc:  # a machine without a C++ compiler still serves, through the torch path
        print(f"heterollm CPU kernels were not built ({type(exc).__name__}: {exc}); attention runs its torch path",
              file=sys.stderr)
        sys.exit(1)
