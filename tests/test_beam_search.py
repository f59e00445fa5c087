"""Beam search on shared KV blocks gives transformers' beam search tokens (float32, every architecture),
also when the request is preempted by recompute and when its prompt is a prefix-cache hit."""
from __future__ import annotations

import pytest
import torch
from worker_oracle import ARCHS, prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from pagedserve.engine import Engine
from shared.sampling import SamplingParams
from shared.settings import Settings

EOS = 1
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny(request.param, tmp_path_factory.mktemp("models") / request.param)
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_beams(hf, prompt: list[int], width: int, n: int, new_tokens: int = NEW_TOKENS,
             length_penalty: float = 1.0, early_stopping: bool | str = False) -> list[list[int]]:
    """transformers' n best beams, each cut after its EOS (generate pads the shorter ones)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, num_beams=width, num_return_sequences=n, max_new_tokens=new_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping)
    beams = []
    for row in out[:, len(prompt):].tolist():
        beams.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return beams


def engine_beams(engine: Engine, batch: list[list[int]], width: int, n: int, new_tokens: int = NEW_TOKENS,
                 **params) -> list[list[list[int]]]:
    sp = SamplingParams(n=n, max_tokens=new_tokens, beam_width=width, **params)
    return [[s.token_ids for s in c.samples] for c in engine.generate(batch, sp)]


@pytest.mark.parametrize("width, n", [(2, 1), (4, 3)])
def test_beams_match_transformers(model, width, n):
    model_dir, hf = model
    batch = prompts([5, 18, 33], seed=21)
    engine = Engine(Settings(model=str(model_dir), num_blocks=96, block_size=16))
    assert engine_beams(engine, batch, width, n) == [hf_beams(hf, p, width, n) for p in batch]


def test_length_penalty_and_early_stopping_as_transformers(model):
    model_dir, hf = model
    (prompt,) = prompts([11], seed=22)
    engine = Engine(Settings(model=str(model_dir), num_blocks=96, block_size=16))
    for length_penalty, early_stopping in [(0.0, "never"), (2.0, "never"), (-1.0, True), (1.0, True)]:
        got = engine_beams(engine, [prompt], 3, 2, length_penalty=length_penalty, early_stopping=early_stopping)
        assert got == [hf_beams(hf, prompt, 3, 2, length_penalty=length_penalty, early_stopping=early_stopping)], \
            (length_penalty, early_stopping)


def test_beams_survive_preemption_by_recompute(model):
    model_dir, hf = model
    batch = prompts([40, 36, 38], seed=23)
    # 15 usable blocks of 8 tokens: one request of 4 beams needs up to 13 (5 shared by the prompt, 2 per beam)
    engine = Engine(Settings(model=str(model_dir), num_blocks=16, block_size=8, max_num_batched_tokens=64))
    assert engine_beams(engine, batch, 4, 2) == [hf_beams(hf, p, 4, 2) for p in batch]
    assert engine.cluster.num_preemptions > 0


def test_beams_on_a_prompt_from_the_prefix_cache(model):
    model_dir, hf = model
    (prompt,) = prompts([37], seed=24)
    engine = Engine(Settings(model=str(model_dir), num_blocks=64, block_size=8))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    assert engine_beams(engine, [prompt], 4, 2) == [hf_beams(hf, prompt, 4, 2)]
    assert engine.cluster.stats(0.0).workers[0].prefix_hits == 32, "the prompt's 4 full blocks came from the cache"
