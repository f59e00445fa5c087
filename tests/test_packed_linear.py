"""bfloat16 and float32 linears on the CPU: oneDNN's packed ones give exactly the plain linears' logits;
kernels/cpu_linear.c's (AMX tiles, AVX-512 BF16 dot products, or float32 fused multiply-adds) and the float32 chunks
give the exact product within float32's summation error, rounded once; cpu_linear.c gives a row the same bits in any
batch, and in pairs of input columns (AMX tiles, AVX-512 BF16) a row alone gets torch's own bfloat16 linear bit for
bit."""
from __future__ import annotations

import pytest
import torch
from kernel_builds import best_kernel, kernel  # noqa: F401 (fixtures)
from worker_oracle import prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from gpu_worker.packed_linear import (ChunkedLinear, NativeLinear, PackedEmbedding, PackedLinear, available_kinds,
                                      linear_kind, native_bfloat16, pack_linears, twin)
from kernels import native

native_only = pytest.mark.skipif(not native_bfloat16(), reason="oneDNN has no native bfloat16 on this CPU")


def packed(way: str, linear: torch.nn.Linear, kernel) -> torch.nn.Module:
    """`linear` packed the `way` given (`packed_linear.twin`) with `kernel`'s build, or the test skipped where the
    build or this CPU lacks it."""
    kinds = available_kinds(kernel, linear.weight.dtype)
    if way not in kinds:
        pytest.skip(f"no {way} here ({', '.join(kinds)})")
    return twin(way, linear, kernel)


@native_only
@pytest.mark.parametrize("tokens,bias", [(1, False), (7, True), (300, True)])
def test_a_packed_linear_computes_what_the_linear_does(tokens, bias):
    gen = torch.Generator().manual_seed(tokens)
    linear = torch.nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(tokens, 96, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), linear(x))
        assert torch.equal(PackedLinear(linear)(x.t().contiguous().t()), linear(x))  # a strided input


@pytest.mark.parametrize("tokens", [5, 40])  # one part tile (6 or 12 rows of fma, 14 of avx512bf16, 16 of amx)
@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "qwen2"])
def test_a_bfloat16_model_with_packed_linears_gives_the_same_logits(arch, tokens, tmp_path, best_kernel):
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
    way = linear_kind(best_kernel)
    assert pack_linears(model, way, best_kernel) > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    kind = {"amx": NativeLinear, "avx512bf16": NativeLinear, "fma": NativeLinear, "onednn": PackedLinear,
            "chunks": ChunkedLinear}[way]
    assert any(isinstance(m, kind) for m in model.modules())
    # tied (gpt2, opt, qwen2): the embedding reads the packed lm_head, so the vocabulary's weights are held once
    shares = model.tie_word_embeddings and kind is NativeLinear
    assert isinstance(model.get_submodule(model.embedding_module), PackedEmbedding) == shares
    if kind is PackedLinear:
        assert torch.equal(logits(), plain)
    else:  # sums in another order (and, widened, float32 sums where torch's fallback sums otherwise)
        torch.testing.assert_close(logits(), plain, atol=0.05, rtol=0.02)


WAYS = ["amx", "avx512bf16", "fma", "chunks"]


def linear_772_to_602(bias: bool, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Linear:
    """602 outputs end in a part panel of cpu_linear.c (and of the chunks' 256 rows); 772 inputs in a part tile row
    of 32."""
    return torch.nn.Linear(772, 602, bias=bias).to(dtype)


def inputs_772(tokens: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`tokens` rows of 772 inputs in each layout a linear is given: rows strided apart, 3-D, columns strided."""
    rows = torch.randn(tokens, 2 * 772).to(dtype)
    return {"rows strided apart": rows[:, :772], "3-D": rows[:, :772].reshape(1, tokens, 772),
            "columns strided apart": rows[:, ::2]}


def in_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x weight^T + bias in float64: exact for these sizes' products and sums, an oracle for any order."""
    return torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("tokens,bias", [(1, False), (5, True), (13, False), (64, True)])
def test_a_bfloat16_linear_gives_the_exact_product_of_the_bfloat16_values_rounded_once(tokens, bias, way, kernel):
    torch.manual_seed(tokens)
    linear = linear_772_to_602(bias)
    module = packed(way, linear, kernel)
    kept = module.weight if way == "chunks" else module.packed
    assert kept.dtype == torch.bfloat16  # no float32 copy of the weights kept
    for name, x in inputs_772(tokens, torch.bfloat16).items():
        exact = in_float64(x, linear.weight, linear.bias)
        with torch.inference_mode():
            out = module(x)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape[:-1] + (602,), name
        # float32 sums of 772 products in any order: within 772 units of float32 of the sum of their magnitudes;
        # then one rounding to bfloat16
        magnitudes = in_float64(x.abs(), linear.weight.abs())
        bound = 772 * 2 ** -24 * magnitudes + 2 ** -8 * exact.abs() * (1 + 2 ** -7)
        assert ((out.double() - exact).abs() <= bound).all(), name


@pytest.mark.parametrize("tokens,bias", [(1, False), (5, True), (13, False), (64, True)])
def test_a_float32_linear_through_cpu_linear_gives_the_exact_product_within_float32_summation_error(tokens, bias,
                                                                                                    kernel):
    """The float32 way of cpu_linear.c (the default where it beats MKL): no bfloat16 anywhere, the inputs read in
    place whatever their row stride."""
    torch.manual_seed(tokens)
    linear = linear_772_to_602(bias, torch.float32)
    module = packed("fma", linear, kernel)
    assert module.packed.dtype == torch.float32
    inputs = inputs_772(tokens, torch.float32)
    inputs["bfloat16"] = inputs["rows strided apart"].to(torch.bfloat16)
    for name, x in inputs.items():
        exact = in_float64(x, linear.weight, linear.bias)
        with torch.inference_mode():
            out = module(x)
        assert out.dtype == x.dtype and out.shape == x.shape[:-1] + (602,), name
        if x.dtype == torch.bfloat16:  # the float32 result rounded once to the input's dtype
            assert torch.equal(out, module(x.float()).to(torch.bfloat16)), name
            continue
        # 772 products and the bias summed in float32: within 773 units of float32 of the sum of their magnitudes
        magnitudes = in_float64(x.abs(), linear.weight.abs(), None if linear.bias is None else linear.bias.abs())
        assert ((out.double() - exact).abs() <= 773 * 2 ** -24 * magnitudes).all(), name


@pytest.mark.parametrize("way,dtype", [("amx", torch.bfloat16), ("avx512bf16", torch.bfloat16),
                                       ("fma", torch.bfloat16), ("fma", torch.float32)])
@pytest.mark.parametrize("k", [772, 771])  # 771: an odd count, the last pair of inputs padded with a zero
def test_cpu_linear_gives_a_row_the_same_bits_in_any_batch(way, dtype, k, kernel):
    """Each output sums its products in one order whatever the batch: a sequence's logits do not change with the
    sequences beside it, nor when a restarted worker recomputes its prefix in one prefill. 70 rows: whole and part
    tiles (of 6, 12, 14 or 16 rows), and AMX's row blocks beyond the first four."""
    torch.manual_seed(0)
    module = packed(way, torch.nn.Linear(k, 602, bias=True).to(dtype), kernel)
    x = torch.randn(70, k).to(dtype)
    with torch.inference_mode():
        batch = module(x)
        for i in range(70):
            assert torch.equal(module(x[i:i + 1]), batch[i:i + 1])
        assert torch.equal(module(x[3:20]), batch[3:20])


@native_only
@pytest.mark.parametrize("way,n,k,bias", [(way, n, k, bias and way == "amx") for way in ("amx", "avx512bf16")
                                          for n, k, bias in [(602, 772, True), (512, 256, False), (40, 96, True),
                                                             (40, 95, True)]])
def test_a_row_alone_in_pairs_of_inputs_gets_torchs_own_bfloat16_linear(way, n, k, bias, kernel):
    """The oracle for the ways that multiply pairs of input columns: torch's bfloat16 linear on this CPU is
    oneDNN's, with the same instructions (AMX tiles, or AVX-512 BF16's vdpbf16ps), and at one row it multiplies and
    adds as cpu_linear.c does (at many rows it splits the sums otherwise). An odd k: the last pair's second input
    is zero. No bias with AVX-512 BF16: there torch rounds the product to bfloat16 before it adds one, where the
    kernel adds it in float32 and rounds once, as torch does with AMX tiles (the exact-product test bounds both).
    Where the CPU has AMX tiles, oneDNN takes them for some shapes: no oracle there for vdpbf16ps."""
    if way == "avx512bf16" and "amx" in native.supported_isas():
        pytest.skip("torch's bfloat16 linear takes AMX tiles on this CPU, not vdpbf16ps alone")
    torch.manual_seed(n)
    linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    module = packed(way, linear, kernel)
    x = torch.randn(8, k).to(torch.bfloat16)
    with torch.inference_mode():
        for row in x.split(1):
            assert torch.equal(module(row), linear(row))


@pytest.mark.parametrize("way,dtype", [("amx", torch.bfloat16), ("fma", torch.bfloat16), ("fma", torch.float32)])
def test_a_tied_embedding_reads_its_rows_from_the_packed_lm_head_bit_for_bit(way, dtype, best_kernel):
    """Both layouts of cpu_linear.c (the pairs' and the fused multiply-adds'; packing needs no AMX, only
    multiplying does), and float32's: every row of the vocabulary, in any shape of ids, and an id out of the
    vocabulary is refused as nn.Embedding refuses it."""
    torch.manual_seed(1)
    embedding = torch.nn.Embedding(602, 772).to(dtype)  # a part panel, a part tile row
    lm_head = torch.nn.Linear(772, 602, bias=False).to(dtype)
    lm_head.weight = embedding.weight
    packed = NativeLinear(lm_head, best_kernel, way)
    pairs = way == "amx"
    # the layout itself, built with torch: panels of 16 rows, as [k][16], or in pairs as [k / 2][16][2] with k padded
    # to 32 and the rows to pairs of panels (pack and unpack share one index function, so a round trip alone would
    # not catch a wrong one)
    rows, cols = (-(-602 // 32) * 32, -(-772 // 32) * 32) if pairs else (-(-602 // 16) * 16, 772)
    padded = torch.nn.functional.pad(embedding.weight.detach(), (0, cols - 772, 0, rows - 602))
    layout = (padded.view(rows // 16, 16, cols // 2, 2).permute(0, 2, 1, 3) if pairs
              else padded.view(rows // 16, 16, cols).permute(0, 2, 1))
    assert torch.equal(packed.packed, layout.flatten())
    shared = PackedEmbedding(packed)
    with torch.inference_mode():
        every = torch.arange(602)
        assert torch.equal(shared(every), embedding(every))
        ids = torch.tensor([[601, 0, 5], [5, 300, 17]])
        assert torch.equal(shared(ids), embedding(ids))
        for wrong in (602, -1):
            with pytest.raises(IndexError, match="out of the vocabulary"):
                shared(torch.tensor([3, wrong]))
