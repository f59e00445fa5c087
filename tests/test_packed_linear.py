"""bfloat16 linears with prepacked weights give exactly the tokens and logits of the plain ones."""
from __future__ import annotations

import pytest
import torch
from worker_oracle import prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from gpu_worker.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN on this CPU")


@pytest.mark.parametrize("tokens,bias", [(1, False), (7, True), (300, True)])
def test_a_packed_linear_computes_what_the_linear_does(tokens, bias):
    gen = torch.Generator().manual_seed(tokens)
    linear = torch.nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(tokens, 96, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), linear(x))
        assert torch.equal(PackedLinear(linear)(x.t().contiguous().t()), linear(x))  # a strided input


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "qwen2"])
def test_a_bfloat16_model_with_packed_linears_gives_the_same_logits(arch, tmp_path):
    from gpu_worker.loader import load_config, load_model
    from gpu_worker.models.layers import ForwardContext

    model_dir = write_tiny(arch, tmp_path / arch)
    model = load_model(model_dir, load_config(model_dir), 64, torch.device("cpu"), torch.bfloat16, progress=False)
    ids = torch.tensor(prompts([12])[0])
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
    assert torch.equal(logits(), plain)
