"""The rotary embedding through kernels/cpu_rotary.c against torch's own bfloat16 ops (layers.apply_rotary):
the same products, sum and roundings, so the same bits, for strided and contiguous heads; head sizes the kernel
leaves to torch stay torch's."""
from __future__ import annotations

import pytest
import torch
from kernel_builds import kernel  # noqa: F401 (fixture)
from worker_oracle import bf16_model_logits

from gpu_worker.models.layers import Rotary, RotaryEmbedding, apply_rotary
from gpu_worker.native_rotary import NativeRotary, swap_rotaries


# 80: a head size left to torch; and every shape in a build without AVX-512, whose kernel leaves it to torch
@pytest.mark.parametrize("tokens,dim", [(300, 64), (7, 128), (5, 80)])
def test_the_native_rotary_is_torchs_bit_for_bit(kernel, tokens, dim):
    torch.manual_seed(dim)
    emb = RotaryEmbedding(dim, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = (torch.randn(tokens, 20, dim) * 3).to(torch.bfloat16)
    qkv[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    cos, sin = emb(torch.arange(tokens) * 37 + 5, torch.bfloat16)
    rotary = NativeRotary(kernel)
    for x in (qkv[:, :16], qkv[:, 4:8].contiguous()):  # the q|k heads of a fused projection; a q_norm's output
        expected = apply_rotary(x, cos, sin)
        out = rotary(x, cos, sin)
        assert out.shape == expected.shape
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.nan_to_num(), expected.nan_to_num())
    with pytest.raises(TypeError, match="bfloat16"):
        rotary(qkv.float(), cos, sin)


def test_a_bfloat16_model_with_native_rotaries_gives_the_same_logits(kernel, tmp_path):
    model, logits = bf16_model_logits("qwen3", tmp_path)  # q and k rotated apart, after their norms
    plain = logits()
    rotaries = sum(isinstance(m, Rotary) for m in model.modules())
    assert swap_rotaries(model, kernel) == rotaries > 1
    assert not any(isinstance(m, Rotary) for m in model.modules())
    assert torch.equal(logits(), plain)

