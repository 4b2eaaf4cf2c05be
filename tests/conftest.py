"""Shared test helpers: run the CLI in a subprocess, fake installed distributions."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest


def pytest_configure(config):
    """Converted model metadata goes to a per-run folder, not the user's cache (tests stay hermetic;
    subprocesses inherit it).

    The engines this test process builds in-process (dozens, sized from the host's memory, some kept
    for a whole module) record their KV reservations in a registry of this process's own, not in the
    run's host registry: otherwise the CLIs and servers the tests start as subprocesses would find
    the host taken by engines that only exist to be inspected. Tests of the host registry itself opt
    back in with the `host_registry` fixture."""
    import tempfile
    if "HETEROLLM_CACHE_DIR" not in os.environ:
        _TEMP_DIRS.append(tempfile.mkdtemp(prefix="heterollm-test-cache-"))
        os.environ["HETEROLLM_CACHE_DIR"] = _TEMP_DIRS[-1]
    from heterollm.engine import reservations

    _TEMP_DIRS.append(tempfile.mkdtemp(prefix="heterollm-test-registry-"))
    private = Path(_TEMP_DIRS[-1]) / "in-process.json"
    reservations.shared_registry_path = reservations.registry_path
    reservations.registry_path = lambda: private


_TEMP_DIRS: list[str] = []
"""The folders pytest_configure made for this run (removed when it ends: a run leaves none behind)."""


def pytest_unconfigure(config):
    import shutil

    for folder in _TEMP_DIRS:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def host_registry(monkeypatch):
    """The run's host registry (the one subprocesses use) for this test's in-process engines."""
    from heterollm.engine import reservations

    monkeypatch.setattr(reservations, "registry_path", reservations.shared_registry_path)


@dataclass
class CliResult:
    rc: int
    out: str
    err: str


def run_cli(*args: str, cwd: str | os.PathLike | None = None, extra_path: str | os.PathLike | None = None,
            timeout: float = 120) -> CliResult:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "heterollm.entrypoints.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def cli():
    return run_cli


def write_fake_dist(root: Path, dist: str, version: str, entry_points: dict[str, dict[str, str]],
                    modules: dict[str, str]) -> Path:
    """Lay out an installed distribution (dist-info + modules) under `root`, as pip would."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for rel, source in modules.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def fake_dists(tmp_path, monkeypatch):
    """Returns add(dist, version, entry_points, modules); the dists are importable in-process
    (sys.path) and for subprocesses (the returned root goes on PYTHONPATH)."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def add(dist, version, entry_points, modules):
        write_fake_dist(root, dist, version, entry_points, modules)
        import importlib
        importlib.invalidate_caches()
        return root

    yield add
    for name in [m for m in sys.modules if m.startswith("fakeplug")]:
        del sys.modules[name]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random llama (tests/helpers.py), built once per test run for the tests that share it."""
    from helpers import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
