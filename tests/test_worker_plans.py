"""The worker core under every kind of plan the scheduler sends: prefix hits, chunked prefill, mixed
steps, swapping, recompute, copy-on-write forks, epochs, finishes, bad plans. Oracle: transformers'
greedy tokens on the same weights (float32)."""
from __future__ import annotations

import pytest
import torch
from plan_builder import PlanBuilder, run_until, step
from worker_oracle import Transformers, prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from gpu_worker.worker import Worker
from shared.protocol import Decodes, NewSequence, ScheduledSequence, StepPlan
from shared.sampling import SamplingParams
from shared.settings import Settings

BLOCK_SIZE = 16
NUM_BLOCKS = 48
NEW = 32
ARCHS = ["llama", "opt"]  # rotary and learned (offset) positions


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    model_dir = write_tiny(request.param, tmp_path_factory.mktemp("models") / request.param)
    return model_dir, Transformers(model_dir)


def make_worker(model_dir, **settings) -> tuple[Worker, PlanBuilder]:
    settings.setdefault("num_blocks", NUM_BLOCKS)
    worker = Worker.load(Settings(model=str(model_dir), block_size=BLOCK_SIZE, swap_space_bytes=1 << 20, **settings),
                    progress=False)
    reg = worker.registration
    return worker, PlanBuilder(reg.worker_id, reg.num_blocks, BLOCK_SIZE, reg.num_swap_blocks)


def test_prefix_cache_hit(model):
    model_dir, hf = model
    worker, builder = make_worker(model_dir)
    first, tail = prompts([40, 9], seed=5)
    a = builder.add(first)
    run_until(worker, builder, [a], 4)
    second = first[:32] + tail
    b = builder.add(second, prefix_of=a, cached_blocks=2)
    builder.schedule(b)
    plan = builder.plan()
    assert (plan.sequences()[0].num_computed_tokens, plan.sequences()[0].num_new_tokens) == (32, 9)
    builder.apply(worker.execute(plan))
    run_until(worker, builder, [a, b], NEW)
    assert b.outputs == hf.greedy(second, NEW)
    assert a.outputs == hf.greedy(first, NEW)

    # control: the same plan over blocks that were never written gives other tokens
    worker, builder = make_worker(model_dir)
    c = builder.add(second)
    c.num_computed = 32
    c.blocks = [builder._alloc(), builder._alloc()]
    run_until(worker, builder, [c], 8)
    assert c.outputs != hf.greedy(second, 8)


def test_chunked_prefill(model):
    model_dir, hf = model
    worker, builder = make_worker(model_dir)
    (prompt,) = prompts([50], seed=6)
    seq = builder.add(prompt)
    while seq.num_computed < len(prompt):
        builder.schedule(seq, min(7, len(prompt) - seq.num_computed))
        result = step(worker, builder)
        assert len(result.outputs) == (1 if seq.num_computed == len(prompt) else 0)
    run_until(worker, builder, [seq], NEW)
    assert seq.outputs == hf.greedy(prompt, NEW)


def test_mixed_prefill_and_decode_steps(model):
    model_dir, hf = model
    worker, builder = make_worker(model_dir)
    short, long, late = prompts([12, 45, 20], seed=7)
    a = builder.add(short)
    run_until(worker, builder, [a], 5)
    b = builder.add(long)
    while b.num_computed < len(long):
        builder.schedule(a)
        builder.schedule(b, min(16, len(long) - b.num_computed))
        plan = builder.plan()
        assert [s.num_new_tokens for s in plan.sequences()][0] == 1
        builder.apply(worker.execute(plan))
    c = builder.add(late)
    run_until(worker, builder, [a, b, c], NEW)
    assert [a.outputs, b.outputs, c.outputs] == [hf.greedy(p, NEW) for p in (short, long, late)]


def test_swap_out_and_back_in(model):
    model_dir, hf = model
    worker, builder = make_worker(model_dir)
    first, second, third = prompts([20, 25, 40], seed=8)
    a, b = builder.add(first), builder.add(second)
    run_until(worker, builder, [a, b], 10)
    old_blocks = list(a.blocks)
    builder.swap_out(a)
    builder.schedule(b)
    step(worker, builder)
    c = builder.add(third)  # takes the blocks a left: their contents are overwritten
    run_until(worker, builder, [b, c], 14)
    assert set(old_blocks) & set(c.blocks)
    builder.swap_in(a)
    assert a.blocks != old_blocks
    run_until(worker, builder, [a, b, c], NEW)
    assert [a.outputs, b.outputs, c.outputs] == [hf.greedy(p, NEW) for p in (first, second, third)]


def test_recompute_after_preemption(model):
    model_dir, hf = model
    worker, builder = make_worker(model_dir)
    first, second = prompts([19, 30], seed=9)
    a, b = builder.add(first), builder.add(second)
    run_until(worker, builder, [a, b], 10)
    resumed = builder.recompute(a)  # freed; re-sent as prompt + the 10 outputs under a new seq id
    assert resumed.seq_id != a.seq_id and resumed.outputs == a.outputs
    builder.schedule(b)
    step(worker, builder)
    run_until(worker, builder, [resumed, b], NEW)
    assert [resumed.outputs, b.outputs] == [hf.greedy(first, NEW), hf.greedy(second, NEW)]


def fork_run(worker: Worker, builder: PlanBuilder, prompt: list[int], params: SamplingParams,
             n: int, new_tokens: int) -> tuple[list, list]:
    """The paper's parallel sampling: sample 0 computes the prompt but its last token, n-1 children share
    its blocks, then all n write their own copy of the shared partly filled block."""
    parent = builder.add(prompt, params)
    builder.schedule(parent, len(prompt) - 1)
    assert step(worker, builder).outputs == []
    samples = [parent] + [builder.fork(parent, i) for i in range(1, n)]
    for s in samples:
        builder.schedule(s)
    plan = builder.plan()
    builder.apply(worker.execute(plan))
    run_until(worker, builder, samples, new_tokens)
    return samples, plan.copies


def test_copy_on_write_fork_greedy(model):
    model_dir, hf = model
    worker, builder = make_worker(model_dir)
    (prompt,) = prompts([21], seed=10)
    samples, copies = fork_run(worker, builder, prompt, SamplingParams(n=3, temperature=0.0, max_tokens=NEW, ignore_eos=True), 3, NEW)
    assert len(copies) == 2  # two writers copy, the last one writes the block in place
    assert all(s.outputs == hf.greedy(prompt, NEW) for s in samples)


def test_copy_on_write_fork_seeded_matches_unshared_runs(model):
    model_dir, _ = model
    (prompt,) = prompts([21], seed=11)
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=NEW, ignore_eos=True)
    worker, builder = make_worker(model_dir)
    samples, copies = fork_run(worker, builder, prompt, params, 3, 16)
    assert copies
    assert len({tuple(s.outputs) for s in samples}) > 1
    for s in samples:
        alone_worker, alone_builder = make_worker(model_dir)
        alone = alone_builder.add(prompt, params, sample_index=s.sample_index)
        run_until(alone_worker, alone_builder, [alone], 16)
        assert alone.outputs == s.outputs


def test_new_epoch_drops_state(model):
    model_dir, hf = model
    worker, builder = make_worker(model_dir)
    (prompt,) = prompts([15], seed=12)
    a = builder.add(prompt)
    run_until(worker, builder, [a], 3)
    stale = StepPlan(builder.worker_id, 1, 0, scheduled=[ScheduledSequence(a.seq_id, len(a.tokens) - 1, 1)])
    outcome = worker.execute(stale)
    assert outcome.outputs == [] and outcome.result.error is None, "an unknown sequence is skipped, its request unknown"
    assert a.seq_id in worker.stopped and not worker.seqs
    fresh = PlanBuilder(builder.worker_id, NUM_BLOCKS, BLOCK_SIZE, epoch=1)
    b = fresh.add(prompt)
    assert b.seq_id == a.seq_id  # ids restart with the epoch
    run_until(worker, fresh, [b], NEW)
    assert b.outputs == hf.greedy(prompt, NEW)


def test_plans_unusable_as_a_whole_are_refused_whole(model):
    """A refused plan changes nothing but this: the sequences it named are skipped from then on (the scheduler
    fails their requests), so that a plan already queued behind it still runs for the others."""
    model_dir, hf = model
    (prompt,) = prompts([18], seed=13)
    worker, builder = make_worker(model_dir)
    wid = builder.worker_id
    a_id = 0
    bad_plans = {
        "already known": StepPlan(wid, 0, 100, new_sequences=[NewSequence(a_id, "x", 0, [5], [], SamplingParams())]),
        "copies": StepPlan(wid, 0, 100, copies=[(0, 3)]),
        "reached": StepPlan("someone-else", 0, 100),
    }
    for needle, plan in bad_plans.items():
        worker, builder = make_worker(model_dir)
        a = builder.add(prompt)
        run_until(worker, builder, [a], 4)
        assert a.seq_id == a_id
        tokens, table = list(worker.seqs[a.seq_id].token_ids), list(worker.seqs[a.seq_id].block_table)
        outcome = worker.execute(plan)
        assert outcome.result.error is not None and needle in outcome.result.error, (needle, outcome.result.error)
        assert outcome.outputs == [] and set(worker.seqs) == {a.seq_id}
        assert (worker.seqs[a.seq_id].token_ids, worker.seqs[a.seq_id].block_table) == (tokens, table)
        named = {m.seq_id for m in plan.new_sequences} | {item.seq_id for item in plan.sequences()}
        assert (a.seq_id in worker.stopped) == (a.seq_id in named)
    b = builder.add(prompt)
    run_until(worker, builder, [b], NEW)
    assert b.outputs == hf.greedy(prompt, NEW)


def test_a_sequence_the_worker_cannot_run_fails_its_request_alone(model):
    """One bad sequence (from a forged or buggy request) must not fail the unrelated sequences of its step:
    the step runs for them, and its request gets a failure entry."""
    model_dir, hf = model
    first, second = prompts([18, 11], seed=13)
    worker, builder = make_worker(model_dir)
    vocab = worker.vocab_size
    bad_items = {
        "vocabulary": lambda b, plan: plan.new_sequences.append(NewSequence(99, "x", 0, [vocab], [], SamplingParams())),
        "does not cover": lambda b, plan: (
            plan.new_sequences.append(NewSequence(99, "x", 0, [5] * 40, [], SamplingParams())),
            plan.scheduled.append(ScheduledSequence(99, 0, 40, [3]))),
        "outside": lambda b, plan: plan.scheduled.append(ScheduledSequence(b.seq_id, len(b.tokens) - 1, 1,
                                                                           [NUM_BLOCKS])),
        "cannot compute": lambda b, plan: plan.scheduled.append(ScheduledSequence(b.seq_id, len(b.tokens) - 1, 2)),
        "scheduled twice": lambda b, plan: plan.scheduled.append(ScheduledSequence(b.seq_id, len(b.tokens) - 1, 1)),
        # the same, in a plan's decodes (the scheduler's fast lane)
        "got block ids outside": lambda b, plan: setattr(plan, "decodes", Decodes([b.seq_id], [len(b.tokens) - 1], [0],
                                                                                  [NUM_BLOCKS])),
        "is scheduled twice": lambda b, plan: setattr(plan, "decodes", Decodes([b.seq_id], [len(b.tokens) - 1])),
    }
    for needle, spoil in bad_items.items():
        worker, builder = make_worker(model_dir)
        a, b = builder.add(first), builder.add(second)
        run_until(worker, builder, [a, b], 4)
        builder.schedule(a)
        if needle.endswith("scheduled twice"):
            builder.schedule(b)
        plan = builder.plan()
        spoil(b, plan)
        outcome = worker.execute(plan)
        failures = outcome.result.refused
        victim = "x" if needle in ("vocabulary", "does not cover") else b.rid
        assert outcome.result.error is None and [f.rid for f in failures] == [victim], (needle, outcome)
        assert needle in failures[0].error and victim not in {out.rid for out in outcome.outputs}
        builder.apply(outcome)
        if victim == b.rid:
            builder.drop(b)
        run_until(worker, builder, [a], NEW)
        assert a.outputs == hf.greedy(first, NEW), needle


def test_finish_reasons(model):
    model_dir, hf = model
    (prompt,) = prompts([10], seed=14)
    expected = hf.greedy(prompt, NEW)
    # the first output that did not occur before is a clean stop token
    index = next(i for i in range(2, NEW) if expected[i] not in expected[:i])
    stop = expected[index]
    worker, builder = make_worker(model_dir)
    capped = builder.add(prompt, SamplingParams(temperature=0.0, max_tokens=5))
    stopped = builder.add(prompt, SamplingParams(temperature=0.0, stop_token_ids=[stop]))
    held = builder.add(prompt, SamplingParams(temperature=0.0, stop_token_ids=[stop], min_tokens=index + 1))
    run_until(worker, builder, [capped, stopped, held], max(index + 1, 5))
    assert capped.finish_reasons[:5] == [None] * 4 + ["length"]
    assert stopped.outputs[:index + 1] == expected[:index + 1]
    assert stopped.finish_reasons[:index + 1] == [None] * index + ["stop"]
    # before min_tokens the stop token is masked out: another token, and no finish
    assert held.outputs[:index] == expected[:index] and held.outputs[index] != stop
    assert held.finish_reasons[:index + 1] == [None] * (index + 1)

    worker, builder = make_worker(model_dir, max_model_len=len(prompt) + 6)
    long = builder.add(prompt, SamplingParams(temperature=0.0, max_tokens=100))
    run_until(worker, builder, [long], 6)
    assert long.finish_reasons == [None] * 5 + ["length"]


def test_a_plan_made_before_a_finish_was_known_computes_nothing_for_that_sequence(model):
    """Async scheduling plans a step before the last one's tokens are back: it may still list a sequence
    that has just finished."""
    model_dir, hf = model
    first, second = prompts([10, 12], seed=16)
    worker, builder = make_worker(model_dir)
    capped = builder.add(first, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    other = builder.add(second)
    run_until(worker, builder, [capped, other], 2)
    assert capped.finish_reasons == [None, "length"]
    builder.schedule(capped)
    builder.schedule(other)
    result = step(worker, builder)
    assert [(out.rid, out.output_index) for out in result.outputs] == [(other.rid, 2)]
    run_until(worker, builder, [other], 8)
    assert other.outputs == hf.greedy(second, 8)


def test_a_failed_step_takes_down_only_its_own_sequences_in_the_plan_after_it(model, monkeypatch):
    """With async scheduling the next plan is already queued when a step fails: it must still run for the
    sequences the failure did not touch. The failure is injected (a GPU error cannot happen on a CPU)."""
    model_dir, hf = model
    first, second, third = prompts([10, 12, 9], seed=17)
    worker, builder = make_worker(model_dir)
    a, b = builder.add(first), builder.add(second)
    run_until(worker, builder, [a, b], 1)
    builder.schedule(a)
    builder.schedule(b)
    failing = builder.plan()
    builder.schedule(a, 1)  # the lookahead: as if the failing step's tokens had come
    builder.schedule(b, 1)
    c = builder.add(third)
    builder.schedule(c)
    ahead = builder.plan()
    forward = worker.runner.execute

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(worker.runner, "execute", broken)
    with pytest.raises(RuntimeError):
        worker.execute(failing)
    monkeypatch.setattr(worker.runner, "execute", forward)
    outcome = worker.execute(ahead)
    assert outcome.result.error is None and [out.rid for out in outcome.outputs] == [c.rid]
    builder.apply(outcome)
    builder.drop(a)  # the scheduler failed their requests
    builder.drop(b)
    run_until(worker, builder, [c], 6)
    assert c.outputs == hf.greedy(third, 6)
    assert not worker.stopped and a.seq_id not in worker.seqs and b.seq_id not in worker.seqs


def test_a_refused_plan_does_not_take_down_the_plan_after_it(model):
    model_dir, hf = model
    first, second = prompts([10, 12], seed=18)
    worker, builder = make_worker(model_dir)
    a = builder.add(first)
    builder.schedule(a)
    refused = builder.plan()
    refused.copies.append((0, 3))  # the null block: the whole plan is refused
    builder.schedule(a, 1)
    b = builder.add(second)
    builder.schedule(b)
    ahead = builder.plan()
    assert "copies pair (0, 3) is out of range" in worker.execute(refused).result.error
    outcome = worker.execute(ahead)
    assert outcome.result.error is None and [out.rid for out in outcome.outputs] == [b.rid]
    builder.apply(outcome)
    builder.drop(a)
    run_until(worker, builder, [b], 4)
    assert b.outputs == hf.greedy(second, 4) and not worker.stopped


def test_logprobs_are_the_model_distribution(model):
    model_dir, hf = model
    (prompt,) = prompts([13], seed=15)
    worker, builder = make_worker(model_dir)
    top3 = builder.add(prompt, SamplingParams(temperature=0.0, logprobs=3, max_tokens=NEW, ignore_eos=True))
    chosen_only = builder.add(prompt, SamplingParams(temperature=0.0, logprobs=0, max_tokens=NEW, ignore_eos=True))
    none = builder.add(prompt, SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=NEW, ignore_eos=True))
    run_until(worker, builder, [top3, chosen_only, none], 8)
    reference = hf.logprobs(top3.tokens)[len(prompt) - 1:-1]
    for i, token in enumerate(top3.outputs):
        assert top3.logprobs[i] == pytest.approx(reference[i, token].item(), abs=1e-4)
        values, ids = reference[i].topk(3)
        assert [t for t, _ in top3.top_logprobs[i]] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top3.top_logprobs[i]]), values, atol=1e-4)
        assert top3.top_logprobs[i][0] == (token, top3.logprobs[i])  # greedy takes the most likely token
    assert chosen_only.logprobs == top3.logprobs and chosen_only.top_logprobs == [[]] * 8
    assert none.logprobs == [None] * 8
