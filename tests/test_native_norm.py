"""RMSNorm of bfloat16 activations through kernels/cpu_norm.c: torch's own F.rms_norm is the oracle (float32
arithmetic, one rounding); the kernel sums the squares in another order, so an output may be one bfloat16 step
away from torch's, rarely, and a row's outputs do not depend on the batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import kernel  # noqa: F401 (fixture)
from worker_oracle import bf16_model_logits, bf16_step

from gpu_worker.models.layers import RMSNorm
from gpu_worker.native_norm import NativeRMSNorm, swap_norms


def norm_of(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-5)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return norm


@pytest.mark.parametrize("size", [64, 100, 256, 768])  # a q/k norm's head; not a multiple of 16; two hidden sizes
def test_a_native_rms_norm_is_torchs_within_one_bfloat16_step(kernel, size):
    torch.manual_seed(size)
    norm = norm_of(size, size)
    x = (torch.randn(300, size) * 3).to(torch.bfloat16)
    expected = F.rms_norm(x, (size,), norm.weight.to(torch.bfloat16), norm.eps)
    out = NativeRMSNorm(norm, kernel)(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert ((out.float() - expected.float()).abs() <= bf16_step(expected)).all()
    assert (out == expected).float().mean() > 0.999


def test_a_rows_norm_is_the_same_bits_in_any_batch_and_from_strided_views(kernel):
    norm = NativeRMSNorm(norm_of(64, 1), kernel)
    qkv = torch.randn(20, 8, 64).to(torch.bfloat16)
    heads = qkv[:, :4]  # the query heads of a fused q|k|v projection, as a q_norm sees them: not contiguous
    batch = norm(heads)
    assert torch.equal(batch, norm(heads.contiguous()))
    for i in range(20):
        assert torch.equal(norm(heads[i:i + 1]), batch[i:i + 1])
    wide = torch.randn(20, 128).to(torch.bfloat16)[:, :64]  # rows 128 apart: the kernel's row stride
    assert torch.equal(norm(wide), norm(wide.contiguous()))
    with pytest.raises(TypeError, match="bfloat16"):
        norm(heads.float())


def test_a_bfloat16_model_with_native_norms_gives_torchs_logits_within_rounding(kernel, tmp_path):
    model, logits = bf16_model_logits("qwen3", tmp_path)  # q and k norms besides the layers' and the final one
    plain = logits()
    norms = sum(isinstance(m, RMSNorm) for m in model.modules())
    assert swap_norms(model, kernel) == norms > 2
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    torch.testing.assert_close(logits(), plain, atol=0.05, rtol=0.02)

