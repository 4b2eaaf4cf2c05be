"""`--model org/name` through huggingface_hub's cache, offline: a hub-layout cache (refs, snapshots,
blobs) built on disk from tiny random models, loaded by id, by branch and by commit; a model
missing from the cache fails in one line naming the cache and `huggingface-cli download`."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from conftest import run_cli

from helpers import build_tiny_model, hf_greedy
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.model_executor.loader import resolve_model

REPO = "tiny-org/tiny-llama"
COMMIT_MAIN, COMMIT_V2 = "a" * 40, "b" * 40
PROMPT = [1, 20, 30, 40, 50]


def add_snapshot(hub: Path, repo_id: str, commit: str, folder: Path, refs: tuple[str, ...]) -> Path:
    """What `huggingface-cli download` leaves: files as blobs named by content hash, a snapshot per
    commit of relative symlinks into them, and refs/<branch or tag> holding the commit."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_models(tmp_path_factory):
    """(hub cache root, {revision: local copy of the model}): main (a 2-layer model, seed 0) and the
    branch v2 (another seed, a narrower MLP)."""
    root = tmp_path_factory.mktemp("hf")
    hub = root / "hub"
    main = build_tiny_model(root / "src-main", "llama", seed=0)
    v2 = build_tiny_model(root / "src-v2", "llama", seed=1, intermediate_size=96)
    add_snapshot(hub, REPO, COMMIT_MAIN, main, ("main",))
    add_snapshot(hub, REPO, COMMIT_V2, v2, ("v2",))
    return root, {"main": main, "v2": v2}


@pytest.fixture
def offline(hub_models, monkeypatch):
    """HF_HOME at the built cache, HF_HUB_OFFLINE=1, for this process (huggingface_hub read its
    environment at import: its constants are set too) and for subprocesses."""
    from huggingface_hub import constants

    root, _ = hub_models
    monkeypatch.setenv("HF_HOME", str(root))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


@pytest.mark.parametrize("revision, commit, width", [(None, COMMIT_MAIN, 128), ("main", COMMIT_MAIN, 128),
                                                      ("v2", COMMIT_V2, 96), (COMMIT_MAIN, COMMIT_MAIN, 128),
                                                      (COMMIT_V2, COMMIT_V2, 96)])
def test_id_resolves_to_the_revisions_snapshot(offline, revision, commit, width):
    source = resolve_model(REPO, revision)
    assert source.folder == offline / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    assert source.hf_config.intermediate_size == width


def test_generate_by_id_and_branch_matches_transformers(offline, hub_models):
    _, local = hub_models
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for revision, folder in [(None, local["main"]), ("v2", local["v2"])]:
        llm = LLM(REPO, revision=revision, dtype="float32", num_gpu_blocks_override=16)
        got = llm.generate([PROMPT], params)[0].outputs[0].token_ids
        assert got == hf_greedy(folder, [PROMPT], 8)[0], revision


@pytest.mark.parametrize("model, revision, fill", [
    ("tiny-org/missing", None, "huggingface-cli download tiny-org/missing`"),
    (REPO, "nope", f"huggingface-cli download {REPO} --revision nope`"),
    (REPO, "c" * 40, f"huggingface-cli download {REPO} --revision {'c' * 40}`"),
])
def test_missing_from_the_cache_says_where_it_looked(offline, model, revision, fill):
    with pytest.raises(ConfigError) as err:
        resolve_model(model, revision)
    msg = str(err.value)
    assert "\n" not in msg and str(offline / "hub") in msg and fill in msg and "HF_HUB_OFFLINE" in msg


def test_cli_exits_2_in_one_line_offline(offline):
    res = run_cli("generate", "--model", "tiny-org/missing", "--prompt", "hi", timeout=60)
    assert res.rc == 2, res.err
    lines = [line for line in res.err.splitlines() if line.startswith("heterollm: error:")]
    assert len(lines) == 1 and str(offline / "hub") in lines[0]
    assert "huggingface-cli download tiny-org/missing" in lines[0]


def test_without_hf_hub_offline_nothing_is_downloaded(hub_models, monkeypatch):
    """HF_HUB_OFFLINE unset: a cached model still needs no connection, and a missing one fails in one
    line at once (heterollm never downloads at run time) instead of reaching for the hub, here a
    closed local port."""
    import time

    from huggingface_hub import constants

    root, _ = hub_models
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert resolve_model(REPO, "v2").hf_config.intermediate_size == 96
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        resolve_model("tiny-org/missing")
    msg = str(err.value)
    assert "\n" not in msg and "does not download" in msg and "huggingface-cli download tiny-org/missing" in msg
    assert "HF_HUB_OFFLINE" not in msg and time.monotonic() - started < 5


def test_revision_with_a_local_folder_is_refused(hub_models):
    _, local = hub_models
    with pytest.raises(ConfigError, match="--revision=v2"):
        resolve_model(str(local["main"]), "v2")


def test_model_id_is_the_served_name():
    from heterollm.config import load_config
    from heterollm.entrypoints.serve import server_settings

    def served(*argv: str) -> list[str]:
        return server_settings(load_config(["--model", REPO, *argv])).served_model_names

    assert served() == [REPO]
    assert served("--model_id", "tiny") == ["tiny"]
    assert served("--model_id", "tiny", "--served_model_name", "other") == ["other"]
