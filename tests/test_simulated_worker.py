"""The simulated worker (gpu_worker/simulated.py) and its cost model (gpu_worker/cost_model.py).

Oracles: step times worked out by hand from the formula; the published sizes of the paper's models and their
KV cache on an A100-40GB; transformers' own count of the built-in model's weights; the in-process engine over
simulated workers (its tokens must not depend on batching, chunking, preemption or the worker). The services
running simulated workers pass the fault tests of tests/test_services.py (parametrized there).
"""
from __future__ import annotations

import dataclasses

import pytest
from plan_builder import PlanBuilder

from gpu_worker.cost_model import (ChunkSize, Device, Efficiency, ModelShape, Profile, ProfileError, get_profile,
                                   load_profiles)
from gpu_worker.simulated import simulated_worker
from shared.sampling import SamplingParams
from shared.settings import Settings

# A toy device and model with round numbers, so that each step time below can be checked by hand.
TOY = Profile(
    name="toy", description="hand-checkable",
    device=Device(name="toy", kind="cuda", memory_bytes=100_000, peak_flops=1000.0, memory_bandwidth=2000.0,
                  host_bandwidth=200.0, source="test"),
    model=ModelShape(name="toy", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                     head_dim=4, vocab_size=10, max_model_len=64, dtype_bytes=2, gated_mlp=True,
                     tied_embeddings=False, learned_positions=0, source="test"),
    efficiency=Efficiency(matmul=0.5, attention=0.25, bandwidth=0.5, step_overhead_s=0.1, seq_overhead_s=0.01,
                          source="test"))
# layer params: q, o 8*2*4 each = 64 + 64; k, v 8*1*4 each = 32 + 32; MLP 3*8*16 = 384 → 576; lm_head 8*10 = 80.
# A step reads (2*576 + 80) * 2 = 2464 bytes of weights; a token's K and V take 2*2*1*4*2 = 32 bytes.
# Rates: FLOPs 1000 * 0.5 = 500/s (dense) and 1000 * 0.25 = 250/s (attention); bytes 2000 * 0.5 = 1000/s.


def test_a_single_decode_token_is_bound_by_its_flops():
    # dense: 2*(2*576*1 + 80*1) = 2464 FLOPs → 4.928 s; weights 2464 B → 2.464 s: FLOPs bound.
    # attention: 4*2*2*4 * 1*(9 + 1) = 640 FLOPs → 2.56 s; K/V 32*(9 + 2) = 352 B → 0.352 s: FLOPs bound.
    assert TOY.step_time([ChunkSize(9, 1)], 1) == pytest.approx(0.1 + 0.01 + 4.928 + 2.56)


def test_long_contexts_make_attention_bound_by_kv_reads():
    # dense: 2*(1152*3 + 80*3) = 7392 FLOPs → 14.784 s (weights 2.464 s).
    # attention: 64 * 3*(1000 + 1) = 192192 FLOPs → 768.768 s; K/V 32*3*(1000 + 2) = 96192 B → 96.192 s.
    assert TOY.step_time([ChunkSize(1000, 1)] * 3, 3) == pytest.approx(0.1 + 0.03 + 14.784 + 768.768)
    # With 16x the FLOPs (as a GPU has), both phases wait on memory: dense 7392 / 8000 = 0.924 s < 2.464 s of
    # weights; attention 192192 / 4000 = 48.048 s < 96.192 s of K/V.
    gpu = dataclasses.replace(TOY, device=dataclasses.replace(TOY.device, peak_flops=16000.0))
    assert gpu.step_time([ChunkSize(1000, 1)] * 3, 3) == pytest.approx(0.1 + 0.03 + 2.464 + 96.192)


def test_a_prefill_chunk_counts_its_causal_attention_and_only_sampled_rows_reach_the_lm_head():
    # A chunk of 4 new tokens after 6 computed ones, not sampled: dense 2*(1152*4) = 9216 FLOPs → 18.432 s;
    # attention 64 * 4*(6 + 5/2) = 2176 FLOPs → 8.704 s (K/V 32*(6 + 8) = 448 B → 0.448 s).
    assert TOY.step_time([ChunkSize(6, 4)], 0) == pytest.approx(0.1 + 0.01 + 18.432 + 8.704)


def test_block_moves_cost_their_bytes_and_an_empty_step_costs_nothing_else():
    # A block of 16 tokens is 512 bytes: 3 swapped over the host link at 200 * 0.5 B/s = 15.36 s; 2 copied,
    # each read and written at 1000 B/s = 2.048 s.
    assert TOY.step_time([], 0, swapped_blocks=3, copied_blocks=2) == pytest.approx(15.36 + 2.048)
    assert TOY.step_time([], 0) == 0.0


def test_the_simulated_models_have_their_published_sizes():
    profiles = load_profiles()
    opt, llama, llama3 = (profiles[p].model for p in ("a100-40gb-opt-13b", "a100-40gb-llama-13b", "h200-llama-3-8b"))
    assert round(opt.num_params / 1e9, 2) == 12.85  # OPT paper, Table 1
    assert round(llama.num_params / 1e9, 1) == 13.0  # LLaMA paper
    assert round(llama3.num_params / 1e9, 2) == 8.03  # Meta-Llama-3-8B
    assert opt.kv_bytes_per_token == 800 * 1024  # the vLLM paper: "800 KB" per token of OPT-13B


def test_the_tiny_profile_counts_the_weights_of_the_built_in_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    matrices = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    shape = get_profile("cpu-tiny").model
    assert shape.num_params == matrices
    assert shape.kv_bytes_per_token == 2 * model.config.num_hidden_layers * model.config.num_key_value_heads \
        * model.config.head_dim * 4


def test_an_a100_40gb_holds_the_kv_cache_the_paper_reports_for_opt_13b():
    """The vLLM paper (Table 1): OPT-13B on one A100-40GB leaves 12 GB for 15.7K tokens of KV cache."""
    worker = simulated_worker(get_profile("a100-40gb-opt-13b"), Settings(), "w", "m", 2048, 50272, [2])
    tokens = (worker.registration.num_blocks - 1) * worker.registration.block_size
    assert abs(tokens - 15_700) / 15_700 < 0.05
    forced = simulated_worker(get_profile("a100-40gb-opt-13b"), Settings(num_blocks=40), "w", "m", 2048, 50272, [2])
    assert forced.registration.num_blocks == 40


def test_an_unknown_profile_is_refused_with_the_names_of_the_known_ones():
    with pytest.raises(ProfileError, match="no simulation profile 'a100-80gb'.*a100-40gb-opt-13b.*cpu-tiny"):
        get_profile("a100-80gb")


def engine(tiny_model_dir, **settings):
    from pagedserve.engine import Engine

    return Engine(Settings(model=str(tiny_model_dir), simulate="cpu-tiny", **settings))


PROMPTS = [[5 + (7 * i + 3 * j) % 400 for j in range(20 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def test_greedy_tokens_depend_on_the_request_alone(tiny_model_dir):
    alone = [engine(tiny_model_dir).generate([p], GREEDY)[0].samples[0].token_ids for p in PROMPTS[:2]]
    batched = engine(tiny_model_dir).generate(PROMPTS, GREEDY)
    squeezed = engine(tiny_model_dir, num_blocks=12, max_num_batched_tokens=16).generate(PROMPTS, GREEDY)
    outputs = [c.samples[0].token_ids for c in batched]
    assert outputs[:2] == alone
    assert [c.samples[0].token_ids for c in squeezed] == outputs, "chunked prefill and preemption change nothing"
    assert len(set(map(tuple, outputs))) == len(PROMPTS), "different prompts, different tokens"


def test_the_tokens_never_end_a_request_early_and_stay_in_the_vocabulary(tiny_model_dir):
    # 6 x 300 tokens over a 512-token vocabulary with 2 EOS ids: a hash that did not skip them would end
    # about 7 sequences early.
    sim = engine(tiny_model_dir)
    completions = sim.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=300))
    eos = set(sim.workers["worker-0"].eos_token_ids)
    for c in completions:
        (sample,) = c.samples
        assert sample.finish_reason == "length" and len(sample.token_ids) == 300
        assert not eos & set(sample.token_ids) and all(0 <= t < 512 for t in sample.token_ids)


def test_sampled_tokens_follow_the_seed_and_the_sample_index(tiny_model_dir):
    params = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=11, logprobs=2)
    first, again = (engine(tiny_model_dir).generate([PROMPTS[0]], params)[0] for _ in range(2))
    other = engine(tiny_model_dir).generate([PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=12, seed=12))[0]
    samples = [s.token_ids for s in first.samples]
    assert samples == [s.token_ids for s in again.samples] and len(set(map(tuple, samples))) == 3
    assert other.samples[0].token_ids != samples[0]
    top = first.samples[0].top_logprobs[0]
    assert top[0][0] == samples[0][0] and len(top) == 2 and first.samples[0].logprobs[0] == top[0][1]


def test_a_refused_plan_does_not_take_down_the_plan_after_it_and_block_moves_take_time():
    profile = get_profile("a100-40gb-opt-13b")
    worker = simulated_worker(profile, Settings(num_blocks=32), "w0", "m", 2048, 50272, [2], pace=False)
    builder = PlanBuilder("w0", 32, 16)
    a = builder.add(list(range(10, 30)))
    builder.schedule(a)
    refused = builder.plan()
    refused.copies.append((0, 3))  # the null block: the whole plan is refused
    builder.schedule(a, 1)
    b = builder.add(list(range(40, 52)))
    builder.schedule(b)
    ahead = builder.plan()
    ahead.copies.append((5, 6))
    assert "copies pair (0, 3) is out of range" in worker.execute(refused).result.error
    outcome = worker.execute(ahead)
    assert outcome.result.error is None and [out.rid for out in outcome.outputs] == [b.rid]
    assert worker.runner.last_step_s == pytest.approx(profile.step_time([ChunkSize(0, 12)], 1, copied_blocks=1))


@pytest.mark.slow
@pytest.mark.redis
def test_up_starts_a_simulated_cluster_that_serves_the_openai_api(tiny_model_dir, tmp_path):
    import urllib.request

    import openai
    from redis_harness import free_port
    from transformers import AutoTokenizer
    from up_harness import UpProcess

    up = UpProcess.start(["--workers", "2", "--simulate", "a100-40gb-opt-13b", "--model", str(tiny_model_dir),
                   "--port", str(free_port()), "--max-model-len", "512"], tmp_path / "up.log")
    try:
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused")
        out = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=12, temperature=0)
        with urllib.request.urlopen(up.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        up.stop()
    from pagedserve.engine import Engine

    reference = Engine(Settings(model=str(tiny_model_dir), simulate="a100-40gb-opt-13b", max_model_len=512))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = [tokenizer.decode(c.samples[0].token_ids, skip_special_tokens=True)
                for c in reference.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12))]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    for worker in ("worker-0", "worker-1"):  # each registered the KV cache an A100-40GB leaves OPT-13B
        assert f'pagedserve_kv_cache_blocks{{worker="{worker}"}} 960.0' in metrics  # 961 but the null block


def test_up_refuses_an_unknown_profile_before_starting_anything(tiny_model_dir):
    from up_harness import run_up

    out = run_up("--simulate", "a100-80gb", "--model", str(tiny_model_dir))
    assert out.returncode == 2 and "no simulation profile 'a100-80gb'" in out.stderr and " (pid " not in out.stderr
