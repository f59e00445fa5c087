"""The gated MLP's activation through kernels/cpu_act.c: torch's own `F.silu(gate) * up` in bfloat16 is the
oracle (float32 arithmetic, rounded after each op); the kernel's exponential is another within-1-ulp one, so an
output may be one bfloat16 step away from torch's, rarely, and a row's outputs do not depend on the batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import avx512_kernel  # noqa: F401 (fixture)
from worker_oracle import bf16_model_logits, bf16_step

from gpu_worker import packed_linear
from gpu_worker.models.layers import GatedMLP, MergedLinear
from gpu_worker.native_mlp import NativeGatedMLP, swap_mlps
from gpu_worker.packed_linear import NativeLinear


@pytest.fixture
def vectorized(avx512_kernel):
    """Each build with AVX-512, where the worker takes this kernel (elsewhere torch's activation is faster)."""
    assert avx512_kernel.bf16_silu_mul_vectorized()
    return avx512_kernel


def torchs(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("n", [2048, 100, 8])  # whole vectors; a tail; the tail alone
def test_the_native_activation_is_torchs_within_one_bfloat16_step(vectorized, n):
    torch.manual_seed(n)
    gate_up = (torch.randn(300, 2 * n) * 4).to(torch.bfloat16)
    special = torch.tensor([0.0, -0.0, 1e-40, 30.0, -30.0, 90.0, -90.0, 88.5, -88.5, float("inf"), -float("inf"),
                            float("nan")])
    gate_up[:len(special), 0] = special  # as gates, beside ordinary ups
    gate_up[:len(special), n] = 3.0
    expected = torchs(gate_up)
    out = NativeGatedMLP(GatedMLP(4, n, "silu", False), vectorized, "fma").activate(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    assert torch.equal(out.isnan(), expected.isnan())
    finite = expected.isfinite()
    assert torch.equal(out[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()])
    assert ((out.float() - expected.float()).abs()[finite] <= bf16_step(expected)[finite]).all()
    assert (out == expected)[finite].float().mean() > 0.999


def test_a_rows_activation_is_the_same_bits_in_any_batch_and_from_strided_views(vectorized):
    act = NativeGatedMLP(GatedMLP(4, 64, "silu", False), vectorized, "fma").activate
    gate_up = (torch.randn(20, 256) * 3).to(torch.bfloat16)[:, :128]  # rows 256 apart: the kernel's row stride
    batch = act(gate_up)
    assert torch.equal(batch, act(gate_up.contiguous()))
    assert torch.equal(act(gate_up.reshape(4, 5, 128)), batch.reshape(4, 5, 64))
    for i in range(20):
        assert torch.equal(act(gate_up[i:i + 1]), batch[i:i + 1])
    with pytest.raises(TypeError, match="bfloat16"):
        act(gate_up.float())


@pytest.mark.parametrize("way", packed_linear.GATED_KINDS)
@pytest.mark.parametrize("n,k,bias", [(100, 772, True), (256, 64, False), (40, 96, True), (24, 95, True)])
def test_the_gate_up_projection_with_the_activation_in_its_epilogue_gives_the_same_bits(vectorized, way, n, k, bias):
    """The gated linear (AMX tiles, AVX-512 BF16) against the projection and the activation apart (each checked
    against torch above and in test_packed_linear): every row count the kernels split otherwise (one row block, up
    to four, more; the column blocks in pairs; tiles of 14 rows), a half that is no multiple of 16, an odd k, a
    bias."""
    kernel = vectorized
    if way not in packed_linear.available_kinds(kernel):
        pytest.skip(f"no {way} in this build or on this CPU")
    torch.manual_seed(n)
    projection = MergedLinear(k, [n, n], bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        projection.weight.normal_(0, 0.05)
        if bias:
            projection.bias.normal_(0, 0.5)
    apart = NativeLinear(projection, kernel, way)
    fused = NativeLinear(projection, kernel, way, gated=True)
    activate = NativeGatedMLP(GatedMLP(4, n, "silu", False), kernel, "fma").activate
    for rows in (1, 5, 14, 16, 17, 64, 70, 300):
        x = (torch.randn(rows, k) * 2).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(fused(x), activate(apart(x))), rows
    with pytest.raises(ValueError, match="no epilogue"):
        NativeLinear(projection, kernel, "fma", gated=True)


@pytest.mark.parametrize("way", ["fma", *packed_linear.GATED_KINDS])
def test_a_bfloat16_model_with_native_mlps_gives_torchs_logits_within_rounding(vectorized, way, tmp_path):
    """With the activation apart (the fma way's linears) and in the gate|up projection's epilogue."""
    if way not in packed_linear.available_kinds(vectorized):
        pytest.skip(f"no {way} in this build or on this CPU")
    model, logits = bf16_model_logits("llama", tmp_path)
    plain = logits()
    mlps = sum(isinstance(m, GatedMLP) for m in model.modules())
    assert swap_mlps(model, vectorized, way) == mlps > 1
    assert not any(isinstance(m, GatedMLP) for m in model.modules())
    assert all(mlp.gated == (way != "fma") for mlp in model.modules() if isinstance(mlp, NativeGatedMLP))
    torch.testing.assert_close(logits(), plain, atol=0.05, rtol=0.02)


def test_other_activations_keep_torchs(vectorized):
    gelu = torch.nn.Sequential(GatedMLP(8, 16, "gelu", False))
    assert swap_mlps(gelu, vectorized, "fma") == 0 and isinstance(gelu[0], GatedMLP)
