"""bfloat16 linears on the CPU: prepacked weights give exactly the logits of the plain linears (CPUs with native
bfloat16); widened ones (on CPUs without: the C kernel, or float32 chunks for MKL without a compiler) give the exact
product within float32's summation error, rounded once, and the C kernel's rows do not depend on the batch."""
from __future__ import annotations

import pytest
import torch
from worker_oracle import prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from gpu_worker import packed_linear
from gpu_worker.packed_linear import PackedLinear, WidenedLinear, native_bfloat16, pack_linears

native_only = pytest.mark.skipif(not native_bfloat16(), reason="oneDNN has no native bfloat16 on this CPU")


@native_only
@pytest.mark.parametrize("tokens,bias", [(1, False), (7, True), (300, True)])
def test_a_packed_linear_computes_what_the_linear_does(tokens, bias):
    gen = torch.Generator().manual_seed(tokens)
    linear = torch.nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(tokens, 96, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), linear(x))
        assert torch.equal(PackedLinear(linear)(x.t().contiguous().t()), linear(x))  # a strided input


@pytest.mark.parametrize("tokens", [5, 12])  # a part tile of the C kernel's 6 rows; two tiles
@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "qwen2"])
def test_a_bfloat16_model_with_packed_linears_gives_the_same_logits(arch, tokens, tmp_path):
    from gpu_worker.loader import load_config, load_model
    from gpu_worker.models.layers import ForwardContext

    model_dir = write_tiny(arch, tmp_path / arch)
    model = load_model(model_dir, load_config(model_dir), 64, torch.device("cpu"), torch.bfloat16, progress=False)
    ids = torch.tensor(prompts([tokens])[0])
    positions = torch.arange(len(ids))

    def logits() -> torch.Tensor:
        # no paged cache needed: a whole prompt attends to itself causally
        def attend(q, k, v, key_cache, value_cache, scale):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), is_causal=True,
                scale=scale, enable_gqa=q.shape[1] != k.shape[1])
            return out.transpose(0, 1).to(q.dtype)
        ctx = ForwardContext([(None, None)] * 8, attend)
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions, ctx))

    plain = logits()
    assert pack_linears(model) > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    if native_bfloat16():
        assert torch.equal(logits(), plain)
    else:  # float32 sums where torch's fallback sums otherwise: within bfloat16's rounding
        assert any(isinstance(m, WidenedLinear) for m in model.modules())
        torch.testing.assert_close(logits(), plain, atol=0.05, rtol=0.02)


def widened_linear(native: bool, monkeypatch, bias: bool) -> tuple[torch.nn.Linear, WidenedLinear]:
    """A 772 → 602 bfloat16 linear and its widened twin: 602 outputs end in a part panel of the C kernel, and the
    fallback's chunks of 256 rows in a short one."""
    if not native:
        monkeypatch.setattr(packed_linear.native, "load", lambda: None)
    elif packed_linear.native.load() is None:
        pytest.skip("no C compiler here")
    linear = torch.nn.Linear(772, 602, bias=bias).to(torch.bfloat16)
    widened = WidenedLinear(linear)
    assert (widened.kernel is not None) == native
    assert widened.weight.dtype == torch.bfloat16  # no float32 copy of the weights kept
    return linear, widened


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "no-compiler"])
@pytest.mark.parametrize("tokens,bias", [(1, False), (5, True), (13, False), (64, True)])
def test_a_widened_linear_gives_the_exact_product_of_the_bfloat16_values_rounded_once(tokens, bias, native,
                                                                                       monkeypatch):
    torch.manual_seed(tokens)
    linear, widened = widened_linear(native, monkeypatch, bias)
    rows = torch.randn(tokens, 2 * 772).to(torch.bfloat16)
    inputs = {"rows strided apart": rows[:, :772], "3-D": rows[:, :772].reshape(1, tokens, 772),
              "columns strided apart": rows[:, ::2]}
    for name, x in inputs.items():
        exact = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                           None if linear.bias is None else linear.bias.double())
        with torch.inference_mode():
            out = widened(x)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape[:-1] + (602,), name
        # float32 sums of 772 products in any order: within 772 units of float32 of the sum of their magnitudes;
        # then one rounding to bfloat16
        magnitudes = torch.nn.functional.linear(x.double().abs(), linear.weight.double().abs())
        bound = 772 * 2 ** -24 * magnitudes + 2 ** -8 * exact.abs() * (1 + 2 ** -7)
        assert ((out.double() - exact).abs() <= bound).all(), name


def test_the_c_kernel_gives_a_row_the_same_bits_in_any_batch(monkeypatch):
    """Each output sums its products in one order whatever the batch: a sequence's logits do not change with the
    sequences beside it, nor when a restarted worker recomputes its prefix in one prefill."""
    torch.manual_seed(0)
    _, widened = widened_linear(True, monkeypatch, bias=True)
    x = torch.randn(13, 772).to(torch.bfloat16)
    with torch.inference_mode():
        batch = widened(x)
        for i in range(13):
            assert torch.equal(widened(x[i:i + 1]), batch[i:i + 1])
        assert torch.equal(widened(x[3:10]), batch[3:10])
