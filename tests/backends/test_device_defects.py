"""Defects that only showed on a device (issue 18), caught on the CPU: the device-mixing detector
itself, rotary tables built for the model's device, per-rank memory queries, dtype support asked
of the vendor library."""
from __future__ import annotations

import pytest
import torch

from heterollm.testing.devices import DeviceMixingDetector, DeviceMixingError


# -- the detector ----------------------------------------------------------------------------------
def test_detector_fails_an_op_mixing_the_fake_device_with_the_cpu():
    with DeviceMixingDetector() as dev:
        x = dev.place(torch.ones(4))
        with pytest.raises(DeviceMixingError, match="cpu, meta"):
            x + torch.ones(4)
        with pytest.raises(DeviceMixingError):
            torch.where(x > 0, x, torch.zeros(4))


def test_detector_runs_device_code_on_real_data():
    with DeviceMixingDetector() as dev:
        x = dev.place(torch.arange(6.0))
        y = torch.tensor([2.0] * 6, device=x.device)
        z = torch.full((6,), 1.0, device=x.device) + x * y
        z[[0, 5]] = 0.0
        assert x.device.type == y.device.type == z.device.type == "meta"
        assert z.tolist() == [0.0, 3.0, 5.0, 7.0, 9.0, 0.0]
        assert int(z.argmax()) == 4 and bool((z > 8).any())
        host = z.to("cpu")
        assert type(host) is torch.Tensor and host.device.type == "cpu"
        assert "aten.mul.Tensor" in dev.ops


def test_detector_allows_what_pytorch_allows():
    with DeviceMixingDetector() as dev:
        x = dev.place(torch.arange(4.0))
        assert (x * torch.tensor(2.0)).tolist() == [0.0, 2.0, 4.0, 6.0]  # a 0-dim CPU tensor is a scalar
        assert x[torch.tensor([1, 3])].tolist() == [1.0, 3.0]  # CPU indices are moved by PyTorch
        x.copy_(torch.ones(4))  # a copy between devices
        assert x.tolist() == [1.0] * 4


def test_detector_without_a_fake_device_checks_real_devices():
    with DeviceMixingDetector(fake=None) as dev:
        with pytest.raises(ValueError):
            dev.place(torch.ones(1))
        with pytest.raises(DeviceMixingError, match="cpu, meta"):
            torch.ones(3, device="meta") + torch.ones(3)
        assert (torch.ones(3) + torch.ones(3)).tolist() == [2.0] * 3


# -- defect 2: rotary tables on the device the model is built on -----------------------------------
ROPE = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 256},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                 "long_factor": [1.5] * 8, "original_max_position_embeddings": 256},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "default": {"rope_type": "default", "rope_theta": 10000.0},
}


def rope_config(name: str):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                       rope_parameters=dict(ROPE[name]))


@pytest.mark.parametrize("name", list(ROPE))
def test_rotary_tables_are_built_on_the_model_device(name):
    from heterollm.model_executor.layers import RotaryEmbedding
    with torch.device("meta"):
        rope = RotaryEmbedding(rope_config(name), head_dim=16, max_positions=64)
    assert rope.cos.device.type == rope.sin.device.type == "meta"
    assert rope.cos.shape == rope.sin.shape == (64, 8)
    host = RotaryEmbedding(rope_config(name), head_dim=16, max_positions=64)
    assert host.cos.device.type == "cpu" and host.cos.dtype == torch.float32


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_a_whole_model_with_scaled_rope_builds_on_the_device(arch):
    """As the runner builds it: under `with torch.device(device)`; every parameter and buffer there."""
    from transformers import LlamaConfig

    from heterollm.model_executor.models import llama
    from heterollm.model_executor.parallel import ParallelContext
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      head_dim=16, rope_parameters=dict(ROPE["llama3"]))
    with torch.device("meta"):
        model = getattr(llama, arch)(cfg, ParallelContext(), 256)
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and {t.device.type for t in tensors} == {"meta"}


# -- a vendor device module, faked -----------------------------------------------------------------
class FakeDeviceModule:
    """What `torch.npu` / `torch.mlu` offer a platform: two devices, the second one current."""

    def __init__(self, bf16: bool | None = None) -> None:
        self.asked: list[int] = []
        self.current = 1
        if bf16 is not None:
            self.is_bf16_supported = lambda: bf16

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.current = index

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self.asked.append(index)
        return (100 + index, 1000 + index)


def fake_platform(base: type, module: FakeDeviceModule):
    """`base` (an ExtensionPlatform) probing `module` instead of importing its vendor library."""
    return type(f"Fake{base.__name__}", (base,), {"_probe": lambda self: (module, "")})()


def extension_platforms():
    from heterollm_mlu.platform import MluPlatform
    from heterollm_npu.platform import NpuPlatform
    return [NpuPlatform, MluPlatform]


# -- defect 3: each rank asks about its own device -------------------------------------------------
def test_every_platform_asks_the_current_device_by_default():
    import inspect

    from heterollm_backend_template.platform import TemplatePlatform
    from heterollm_cpu.platform import CpuPlatform
    from heterollm_cuda.platform import CudaPlatform

    from heterollm.interfaces import Platform
    from heterollm.model_executor.device_backend import ExtensionPlatform
    for cls in (Platform, CpuPlatform, CudaPlatform, ExtensionPlatform, TemplatePlatform, *extension_platforms()):
        assert inspect.signature(cls.memory_info).parameters["device"].default is None, cls.__name__


@pytest.mark.parametrize("index", [0, 1])
def test_extension_platform_memory_is_the_bound_device(index):
    for base in extension_platforms():
        module = FakeDeviceModule()
        platform = fake_platform(base, module)
        platform.set_device(index)  # the rank's local index
        assert platform.memory_info() == (100 + index, 1000 + index)
        assert platform.memory_info(0) == (100, 1000)
        assert module.asked == [index, 0]


def test_cuda_platform_memory_is_the_current_device(monkeypatch):
    from heterollm_cuda.platform import CudaPlatform
    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (asked.append(i), (7, 9))[1])
    assert CudaPlatform().memory_info() == (7, 9)
    assert asked == [1]


# -- defect 5: bf16 only where the vendor library says so ------------------------------------------
@pytest.mark.parametrize("bf16,expected", [(True, True), (False, False), (None, False)],
                         ids=["has-bf16", "mlu370-no-bf16", "library-cannot-say"])
def test_extension_platform_asks_the_vendor_library_for_bf16(bf16, expected):
    for base in extension_platforms():
        platform = fake_platform(base, FakeDeviceModule(bf16))
        assert platform.supports_dtype("bfloat16") is expected, base.__name__
        assert platform.supports_dtype("float16") and platform.supports_dtype("float32")


def test_dtype_auto_avoids_bf16_where_the_device_lacks_it():
    from types import SimpleNamespace

    from heterollm.model_executor.runner import resolve_dtype
    from heterollm_mlu.platform import MluPlatform
    bf16_checkpoint = SimpleNamespace(dtype=torch.bfloat16)
    assert resolve_dtype("auto", bf16_checkpoint, fake_platform(MluPlatform, FakeDeviceModule(False)),
                         False) != torch.bfloat16
    assert resolve_dtype("auto", bf16_checkpoint, fake_platform(MluPlatform, FakeDeviceModule(True)),
                         False) == torch.bfloat16


def test_explicit_bf16_is_refused_at_launch_where_the_device_lacks_it(monkeypatch):
    from heterollm.config import load_config
    from heterollm_mlu.platform import MluPlatform
    config = load_config([], overrides={"model": "x", "dtype": "bfloat16"}).config
    problems = fake_platform(MluPlatform, FakeDeviceModule(False)).validate(config)
    assert any("--dtype=bfloat16" in p for p in problems)
    assert not fake_platform(MluPlatform, FakeDeviceModule(True)).validate(config)


# -- defect 6: each tensor-parallel rank bound to its local device and seeded ----------------------
def tp_config(tp_size: int, nnodes: int = 1, seed: int = 1):
    from heterollm.config import load_config
    return load_config([], overrides={"tp_size": tp_size, "nnodes": nnodes, "random_seed": seed}).config


def test_local_rank_honours_launchers_then_the_nodes_share(monkeypatch):
    from heterollm.distributed.worker import local_rank
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [local_rank(tp_config(4, nnodes=2), r) for r in (2, 3)] == [0, 1]  # the second node's ranks
    assert local_rank(tp_config(3), 2) == 2
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert local_rank(tp_config(4, nnodes=2), 2) == 5


class RecordingPlatform:
    device_type = "cpu"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def set_device(self, local_rank: int) -> None:
        self.calls.append(("set_device", local_rank))

    def seed(self, seed: int) -> None:
        self.calls.append(("seed", seed))


def test_every_rank_is_bound_to_its_local_device_and_seeded(monkeypatch):
    from heterollm.distributed.worker import _bind
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    platform = RecordingPlatform()
    _bind(platform, tp_config(4, nnodes=2, seed=7), 3)
    assert platform.calls == [("set_device", 1), ("seed", 7)]
    unseeded = RecordingPlatform()
    _bind(unseeded, tp_config(2, seed=-1), 1)
    assert unseeded.calls == [("set_device", 1)]


def test_collective_device_is_the_bound_device_and_none_on_the_host(monkeypatch):
    from heterollm.distributed.worker import collective_device
    assert collective_device(RecordingPlatform()) is None
    accelerator = RecordingPlatform()
    accelerator.device_type = "meta"  # stands for any accelerator: its device module says device 1 is bound
    monkeypatch.setattr(torch, "get_device_module", lambda kind: FakeDeviceModule())
    assert collective_device(accelerator) == torch.device("meta", 1)


@pytest.mark.parametrize("device", [None, torch.device("meta", 1)])
def test_the_process_group_is_bound_to_the_device(monkeypatch, device):
    from heterollm.distributed import communicator as comm
    seen = {}
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(comm.dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    comm.TorchDistributedCommunicator(1, 2, "tcp://127.0.0.1:1", device=device)
    assert seen.get("device_id") == device and ("device_id" in seen) == (device is not None)
