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
