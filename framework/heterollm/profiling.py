"""Online timeline profiling (`--enable_online_profile`, `--profile_backend`, `--profile_dir`): a
trace of what every rank ran between `POST /start_profile` and `POST /stop_profile` (or
`LLM.start_profile()` / `LLM.stop_profile()`), one file per rank, to open in Perfetto
(ui.perfetto.dev) or chrome://tracing.

The profiler itself is the platform's (`Platform.trace_profiler`): torch's profiler over the
platform's activities by default, a vendor tool where a backend offers one. Each rank starts and
stops it on the thread that runs its steps, between two steps."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from heterollm.interfaces.platform import TraceProfiler

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig
    from heterollm.interfaces import Platform

TORCH_TRACE_SUFFIX = ".pt.trace.json.gz"


class TorchTraceProfiler(TraceProfiler):
    """torch.profiler (Kineto) over `activities`; stop writes a gzipped Chrome trace. A vendor's
    torch-style profiler (torch_npu's) overrides `_open` and `_written`."""

    def __init__(self, activities: list) -> None:
        self.activities = activities
        self._prof = None
        self._stem: Path | None = None

    def _open(self, stem: Path):
        """A new, not yet started profiler object that records into `stem`."""
        from torch.profiler import profile

        return profile(activities=self.activities, record_shapes=True)

    def _written(self, prof, stem: Path) -> list[Path]:
        """Write what the stopped `prof` recorded; the paths written."""
        path = stem.with_name(stem.name + TORCH_TRACE_SUFFIX)
        prof.export_chrome_trace(str(path))
        return [path]

    def start(self, stem: Path) -> None:
        self._stem = stem
        self._prof = self._open(stem)
        self._prof.start()

    def stop(self) -> list[Path]:
        prof, self._prof = self._prof, None
        if prof is None:
            return []
        prof.stop()
        return self._written(prof, self._stem)


def trace_dir(config: HeterollmConfig) -> Path:
    """--profile_dir, or the working directory when it is empty (as xLLM)."""
    return Path(config.profile.profile_dir or os.getcwd()).expanduser()


def check_profile_flags(config: HeterollmConfig, platform: Platform) -> list[str]:
    """Launch problems of the profiling flags on `platform`: one line each, naming the flag."""
    prof = config.profile
    problems = []
    if not prof.enable_online_profile:
        for name, default in (("profile_backend", "torch"), ("profile_dir", "")):
            if getattr(prof, name) != default:
                problems.append(f"--{name}={getattr(prof, name)}: only --enable_online_profile uses it (set that too)")
        return problems
    if prof.profile_backend not in platform.profilers:
        offered = "; ".join(f"{name}: {what}" for name, what in platform.profilers.items())
        problems.append(f"--profile_backend={prof.profile_backend}: the {platform.name} platform does not offer it "
                        f"(it offers {offered})")
    folder = trace_dir(config)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problems.append(f"--profile_dir={prof.profile_dir}: cannot create {folder} ({exc.strerror})")
    else:
        if not os.access(folder, os.W_OK):
            problems.append(f"--profile_dir={prof.profile_dir or '(the working directory)'}: {folder} is not writable")
    return problems


class RankProfiler:
    """One rank's profiling sessions: `start`, then `stop` writes this rank's trace."""

    def __init__(self, platform: Platform, backend: str, folder: Path, rank: int) -> None:
        self.platform, self.backend, self.folder, self.rank = platform, backend, folder, rank
        self._active: TraceProfiler | None = None

    def start(self) -> None:
        if self._active is not None:
            raise RuntimeError("a profile is already being recorded")
        profiler = self.platform.trace_profiler(self.backend)
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
        profiler.start(self.folder / f"heterollm-{stamp}-rank{self.rank}")
        self._active = profiler

    def stop(self) -> list[str]:
        profiler, self._active = self._active, None
        if profiler is None:
            raise RuntimeError("no profile is being recorded")
        return [str(p) for p in profiler.stop()]
