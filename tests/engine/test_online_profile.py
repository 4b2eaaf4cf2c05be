"""--enable_online_profile: start_profile / stop_profile (offline and POST /start_profile,
/stop_profile) write one trace per rank into --profile_dir holding the operators the steps between
them ran, on the thread that runs the steps (schedule overlap included) and on every tensor-parallel
rank; misuse is a clear refusal naming the flag or the state; the flags fail at launch where they
cannot work."""
from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from helpers import TRACED_FORWARD as FORWARD
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.plugins.resolver import LaunchError
from heterollm.scheduler.request import RequestRejected

FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def operators(path: str) -> set[str]:
    """The operator names (aten::, mkldnn::, ...) a gzipped Chrome trace records."""
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    return {e.get("name", "") for e in trace["traceEvents"] if "::" in e.get("name", "")}


def _recorded(llm: LLM, work: bool) -> set[str]:
    llm.start_profile()
    if work:
        llm.generate([[5, 6, 7, 8, 9]], GREEDY)
    files = llm.stop_profile()
    assert len(files) == 1 and Path(files[0]).is_file(), files
    return operators(files[0])


@pytest.mark.parametrize("overlap", [False, True], ids=["steps-on-the-caller", "schedule-overlap"])
def test_a_profile_records_the_steps_between_start_and_stop(tiny_llama, tmp_path, overlap):
    llm = LLM(str(tiny_llama), **FLAGS, enable_online_profile=True, profile_dir=str(tmp_path),
              enable_schedule_overlap=overlap)
    try:
        busy = _recorded(llm, work=True)
        idle = _recorded(llm, work=False)
    finally:
        llm.shutdown()
    # the model's embedding lookup and MLP activation and the greedy sampler's argmax (the op registry's:
    # torch's, or the CPU backend's kernel where it is built) ran between start and stop, on the thread
    # that runs the steps
    picks = {"aten::argmax", "heterollm_cpu::argmax_rows"}
    assert FORWARD <= busy and picks & busy, sorted(busy)
    assert not FORWARD & idle and not picks & idle  # nothing ran: nothing recorded
    assert sorted(p.name.endswith("-rank0.pt.trace.json.gz") for p in tmp_path.iterdir()) == [True, True]


def test_misuse_is_refused_with_the_flag_or_the_state(tiny_llama, tmp_path, caplog):
    plain = LLM(str(tiny_llama), **FLAGS)
    try:
        with pytest.raises(RequestRejected, match="--enable_online_profile") as exc:
            plain.start_profile()
        assert exc.value.field == "enable_online_profile"
        assert str(exc.value).endswith("online profiling needs --enable_online_profile (and, optionally, "
                                       "--profile_dir and --profile_backend)")
    finally:
        plain.shutdown()
    llm = LLM(str(tiny_llama), **FLAGS, enable_online_profile=True, profile_dir=str(tmp_path))
    try:
        with pytest.raises(RequestRejected, match="no profile is being recorded"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RequestRejected, match="already being recorded") as exc:
            llm.start_profile()
        assert str(exc.value).endswith("a profile is already being recorded; stop it first")
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 4  # the engine goes on
    finally:
        with caplog.at_level(logging.INFO, logger="heterollm"):
            llm.shutdown()  # a profile still recording is written at shutdown, not lost
    [trace] = tmp_path.iterdir()
    assert trace.name.endswith(".pt.trace.json.gz")
    assert f"online profile written: {trace}" in [r.getMessage() for r in caplog.records]


def test_a_profile_that_cannot_be_written_at_shutdown_is_one_warning(tiny_llama, tmp_path, caplog):
    """The trace folder replaced by a file while a profile records: shutdown still completes, and says
    why the profile was lost."""
    folder = tmp_path / "traces"
    llm = LLM(str(tiny_llama), **FLAGS, enable_online_profile=True, profile_dir=str(folder))
    llm.start_profile()
    folder.rmdir()  # empty until the trace is written
    folder.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="heterollm"):
        llm.shutdown()
    [message] = [r.getMessage() for r in caplog.records if "online profile" in r.getMessage()]
    assert message.startswith(f"could not write the online profile at shutdown: [Errno 20] Not a directory: "
                              f"'{folder}/heterollm-") and message.endswith("-rank0.pt.trace.json.gz'")


@pytest.mark.parametrize("flags,message", [
    ({"enable_online_profile": True, "profile_backend": "cuda"},
     "--profile_backend=cuda: the cpu platform does not offer it (it offers torch: torch.profiler"),
    ({"enable_online_profile": True, "profile_backend": "ascend"}, "--profile_backend=ascend: the cpu platform"),
    # any name passes the flag parser: the platform decides, so a vendor's own profiler needs no core edit
    ({"enable_online_profile": True, "profile_backend": "vendor_tool"}, "--profile_backend=vendor_tool: the cpu "
     "platform does not offer it"),
    ({"profile_dir": "/tmp/x"}, "--profile_dir=/tmp/x: only --enable_online_profile uses it"),
    ({"profile_backend": "cuda"}, "--profile_backend=cuda: only --enable_online_profile uses it"),
])
def test_flags_that_cannot_work_fail_at_launch(tiny_llama, flags, message):
    with pytest.raises((LaunchError, ConfigError), match=message.replace("(", r"\(")):
        LLM(str(tiny_llama), **FLAGS, **flags)


def test_an_unwritable_profile_dir_fails_at_launch(tiny_llama, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises((LaunchError, ConfigError), match=f"--profile_dir={blocker}/traces: cannot create"):
        LLM(str(tiny_llama), **FLAGS, enable_online_profile=True, profile_dir=str(blocker / "traces"))


def test_every_tensor_parallel_rank_writes_its_trace(tiny_llama, tmp_path):
    llm = LLM(str(tiny_llama), **FLAGS, tp_size=2, enable_online_profile=True, profile_dir=str(tmp_path))
    try:
        llm.start_profile()
        llm.generate([[5, 6, 7, 8, 9]], GREEDY)
        files = sorted(llm.stop_profile())
    finally:
        llm.shutdown()
    assert sorted(Path(f).name.rsplit("-", 1)[1] for f in files) == ["rank0.pt.trace.json.gz",
                                                                      "rank1.pt.trace.json.gz"]
    for f in files:  # each rank ran its half of the model
        assert FORWARD <= operators(f), f


def test_the_npu_profiler_drives_torch_npus_profiler(monkeypatch, tmp_path):
    """No NPU here: a stand-in torch_npu records what the NPU backend's profiler asks of it (the API
    of torch_npu.profiler: profile(activities=[CPU, NPU], on_trace_ready=tensorboard_trace_handler(dir)))."""
    import sys
    import types

    calls = []

    class Profile:
        def __init__(self, activities, on_trace_ready, record_shapes):
            calls.append(("profile", tuple(activities), on_trace_ready, record_shapes))

        def start(self):
            calls.append(("start",))

        def stop(self):
            calls.append(("stop",))

    profiler = types.SimpleNamespace(profile=Profile, ProfilerActivity=types.SimpleNamespace(CPU="cpu", NPU="npu"),
                                     tensorboard_trace_handler=lambda folder: ("handler", folder))
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(profiler=profiler))
    from heterollm_npu.platform import NpuPlatform

    platform = NpuPlatform()
    assert set(platform.profilers) == {"torch"}
    with pytest.raises(ValueError, match="--profile_backend=ascend: the npu platform offers torch"):
        platform.trace_profiler("ascend")
    prof = platform.trace_profiler("torch")
    prof.start(tmp_path / "heterollm-x-rank0")
    assert prof.stop() == [tmp_path / "heterollm-x-rank0"] and prof.stop() == []
    assert calls == [("profile", ("cpu", "npu"), ("handler", str(tmp_path / "heterollm-x-rank0")), True),
                     ("start",), ("stop",)]
