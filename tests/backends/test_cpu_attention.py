"""CpuPagedAttention against a dense reference: the conformance kit's attention check (mixed
batches over shuffled block tables, the cache starting as NaN as uninitialized memory may, so any
read of an unwritten or padding slot that escapes the mask shows up), at more block sizes and
steps than the kit runs."""
import pytest
import torch

from heterollm.testing.conformance import check_paged_attention
from heterollm_cpu.attention import CpuPagedAttention


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_mixed_steps_match_dense_reference(block_size):
    check_paged_attention(CpuPagedAttention(), torch.device("cpu"), block_size, steps=12)
