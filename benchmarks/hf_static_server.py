"""The static-batching baseline: a minimal OpenAI-compatible /v1/completions server around transformers.

What the vLLM paper compares against when it says "static batching": one batch at a time. When the model
is idle the server takes what is waiting (up to --max-batch-size requests, first come first served),
left-pads the prompts, and runs `generate` until the longest requested output is done; requests arriving
meanwhile wait for the next batch. No KV paging, no joining a running batch. With --kv-budget-tokens the
batch is also capped by memory, as a serving system's KV cache is: transformers' cache holds every row to
the padded width plus the longest output, so a batch of k requests takes k * (longest prompt + longest
max_tokens) token slots, and the batch stops growing (first come, first served) before that passes the budget.

Streaming is accepted but nothing is sent before the batch ends: then every token of the request goes
out at once, so a client measures time to first token = queueing + the whole batch, and inter-token
gaps near zero. Decoding is greedy; `ignore_eos` requests run with min_new_tokens = max_new_tokens so
their lengths hold (a batch never mixes ignore_eos and normal requests).

    python -m benchmarks.hf_static_server --model DIR --port 8100 --max-batch-size 16 [--kv-budget-tokens 2048]

Prints `ready: http://HOST:PORT` once it listens; SIGTERM or Ctrl-C stops it.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from benchmarks.baselines import Completion, PendingRequest, StaticBatchGenerator, take_static_batch
from shared.model_dir import ModelDirError, resolve_model_dir

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class BadRequest(ValueError):
    """The request cannot be served; the message goes back to the client in an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool


def parse_request(body: Any, gen: StaticBatchGenerator, model_name: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {model_name!r}", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = gen.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids = prompt
        bad = next((t for t in ids if not 0 <= t < gen.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {gen.vocab_size})", "prompt")
    else:
        raise BadRequest("prompt must be one string or one non-empty list of token ids", "prompt")
    if not ids:
        raise BadRequest("the prompt encodes to no token", "prompt")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    if len(ids) + max_tokens > gen.max_model_len:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                         f"{gen.max_model_len} positions", "max_tokens")
    temperature = body.get("temperature", 0)
    if not isinstance(temperature, (int, float)) or temperature != 0:
        raise BadRequest("this baseline decodes greedily: temperature must be 0", "temperature")
    if body.get("n", 1) != 1:
        raise BadRequest("this baseline serves n = 1 only", "n")
    stream = body.get("stream", False)
    ignore_eos = body.get("ignore_eos", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(ignore_eos, bool) or not isinstance(options, dict):
        raise BadRequest("stream and ignore_eos must be booleans, stream_options an object")
    return ParsedRequest(ids, max_tokens, ignore_eos, stream, bool(options.get("include_usage", False)))


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


class StaticBatchServer:
    """The HTTP front and the batch loop; generation runs in a thread so the loop keeps accepting requests."""

    def __init__(self, gen: StaticBatchGenerator, model_name: str, max_batch_size: int,
                 kv_budget_tokens: int = 0) -> None:
        self.gen = gen
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.kv_budget_tokens = kv_budget_tokens
        self.waiting: collections.deque[PendingRequest] = collections.deque()
        self.wakeup = asyncio.Event()
        self.running = 0
        self.batches = 0

    def take_batch(self) -> list[PendingRequest]:
        batch = take_static_batch(list(self.waiting), self.max_batch_size, self.kv_budget_tokens)
        taken = {id(r) for r in batch}
        self.waiting = collections.deque(r for r in self.waiting if id(r) not in taken)
        return batch

    async def batch_loop(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.waiting:
                batch = [r for r in self.take_batch() if not r.done.done()]  # skip requests whose client left
                if not batch:
                    continue
                self.running = len(batch)
                try:
                    results = await asyncio.to_thread(self.gen.generate, [r.prompt_ids for r in batch],
                                                      [r.max_tokens for r in batch], batch[0].ignore_eos)
                except Exception as e:  # a failed batch fails its requests, not the server
                    for r in batch:
                        if not r.done.done():
                            r.done.set_exception(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
                else:
                    for r, result in zip(batch, results):
                        if not r.done.done():
                            r.done.set_result(result)
                self.running = 0
                self.batches += 1

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON")
        try:
            req = parse_request(body, self.gen, self.model_name)
        except BadRequest as e:
            return _error(400 if e.param != "model" else 404, str(e), e.param)
        pending = PendingRequest(req.prompt_ids, req.max_tokens, req.ignore_eos,
                                 asyncio.get_running_loop().create_future())
        self.waiting.append(pending)
        self.wakeup.set()
        try:
            result: Completion = await pending.done
        except RuntimeError as e:
            return _error(500, str(e))
        finally:
            if not pending.done.done():
                pending.done.cancel()  # the client left: the batch loop skips it
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(result.token_ids),
                 "total_tokens": len(req.prompt_ids) + len(result.token_ids)}
        deltas = self.gen.text_deltas(result.token_ids)
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if not req.stream:
            choice = {"index": 0, "text": "".join(deltas), "logprobs": None, "finish_reason": result.finish_reason}
            return web.json_response({**head, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        last = len(deltas) - 1
        for i, text in enumerate(deltas):
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": result.finish_reason if i == last else None}
            await resp.write(f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode())
        if req.include_usage:
            await resp.write(f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "hf-static-baseline",
             "max_model_len": self.gen.max_model_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE static_requests_running gauge", f"static_requests_running {self.running}",
                 "# TYPE static_requests_waiting gauge", f"static_requests_waiting {len(self.waiting)}",
                 "# TYPE static_batches_total counter", f"static_batches_total {self.batches}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        app.add_routes([web.post("/v1/completions", self.completions), web.get("/v1/models", self.models),
                        web.get("/metrics", self.metrics), web.get("/health", self.health)])
        return app


async def serve(args: argparse.Namespace) -> None:
    model_dir = resolve_model_dir(str(args.model))
    gen = StaticBatchGenerator(model_dir.path, args.device, args.dtype)
    server = StaticBatchServer(gen, model_dir.served_name(args.served_model_name), args.max_batch_size,
                               args.kv_budget_tokens)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    loop_task = asyncio.create_task(server.batch_loop())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"ready: http://{args.host}:{args.port}", flush=True)
    await stop.wait()
    loop_task.cancel()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="static-batching baseline server (transformers generate)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--served-model-name", default="", help="model id clients use (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--kv-budget-tokens", type=int, default=0,
                   help="KV token slots a batch may take: rows * (longest prompt + longest max_tokens); 0 = no cap")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU variant")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.max_batch_size < 1:
        p.error("--max-batch-size must be at least 1")
    if args.kv_budget_tokens < 0:
        p.error("--kv-budget-tokens must be 0 (no cap) or more")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        asyncio.run(serve(args))
    except ModelDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
