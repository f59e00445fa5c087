"""Every request field OpenAI or vLLM defines for the routes pagedserve serves, and what pagedserve does with it:
honoured, or refused with a 400 naming it (unless its value asks for nothing). A field neither defines is refused
too, as OpenAI refuses one: a typo or another server's extension never passes unnoticed.

This table is the one place that decides; `gateway/request_model.py` parses by it and the README's field list is
rendered from it (tests/test_request_fields.py holds the two equal, and the table complete against the openai
client's own parameter types and vLLM's request models).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPENAI, VLLM, BOTH, OURS = "OpenAI", "vLLM", "OpenAI, vLLM", "pagedserve"
CONSTRAINED = "the output is constrained to it on the worker (llguidance); one constraint per request"
RESPONSE_FORMAT = ("{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                   "{\"name\", \"schema\", \"strict\"}}: " + CONSTRAINED)
BEST_OF = ("samples per prompt (≥ n) on shared blocks, the n of highest cumulative logprob returned best first; "
           "with `use_beam_search` the beam width")


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    defined_by: str
    meaning: str  # what pagedserve does with it, or why it refuses it
    refused: bool = False
    nothing: tuple[Any, ...] = (None,)  # values of a refused field that ask for nothing, so pass

    def refuses(self, value: Any) -> bool:
        return self.refused and not any(type(value) is type(v) and value == v for v in self.nothing)


def _honoured(name: str, by: str, meaning: str) -> Field:
    return Field(name, by, meaning)


def _refused(name: str, by: str, meaning: str, *nothing: Any) -> Field:
    return Field(name, by, meaning, refused=True, nothing=(None, *nothing))


def _table(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


_SAMPLING = (
    _honoured("model", BOTH, "the served model's id (`GET /v1/models`); another is a 404"),
    _honoured("n", BOTH, "choices per prompt (1-128), sampled on the prompt's shared KV blocks"),
    _honoured("temperature", BOTH, "0-2; 0 is greedy"),
    _honoured("top_p", BOTH, "(0, 1]"),
    _honoured("top_k", VLLM, "0 or -1 = off"),
    _honoured("min_p", VLLM, "[0, 1]"),
    _honoured("seed", BOTH, "0 to 2^63-1: the draws are a pure function of seed, sample and position"),
    _honoured("presence_penalty", BOTH, "[-2, 2], over the output"),
    _honoured("frequency_penalty", BOTH, "[-2, 2], over the output"),
    _honoured("repetition_penalty", VLLM, "(0, 2], over prompt and output"),
    _honoured("logit_bias", BOTH, "token id → bias in [-100, 100], added to the logits before penalties and "
              "sampling (logprobs stay the model's own); ids checked against the vocabulary; not with beam search"),
    _honoured("allowed_token_ids", VLLM, "sampling only among these ids"),
    _honoured("stop", BOTH, "strings that end a choice (cut from its text)"),
    _honoured("include_stop_str_in_output", VLLM, "keep the stop string that ended a choice in its text"),
    _honoured("stop_token_ids", VLLM, "token ids that end a choice"),
    _honoured("ignore_eos", VLLM, "generate past EOS"),
    _honoured("min_tokens", VLLM, "stop tokens are masked until this many tokens"),
    _honoured("skip_special_tokens", VLLM, "leave special tokens out of the text (default true)"),
    _refused("spaces_between_special_tokens", VLLM, "the tokenizers decode as their own `tokenizer.json` says (a "
             "fast tokenizer has no such switch)", True),
    _honoured("use_beam_search", VLLM, "beam search of width best_of (or n), the n best returned; not streamed"),
    _honoured("length_penalty", VLLM, "beam scores divide by length ** length_penalty (beam search only)"),
    _honoured("early_stopping", OURS, "beam search: true, false or \"never\", as transformers' generate"),
    _honoured("prompt_logprobs", VLLM, "k (0-20): each prompt token's logprob, rank and the k likeliest, in vLLM's "
              "shape; not with stream"),
    _honoured("truncate_prompt_tokens", VLLM, "keep only this many prompt tokens (-1: max_model_len - 1), from the "
              "side `truncation_side` says"),
    _honoured("truncation_side", VLLM, "\"left\" (default: the last tokens are kept) or \"right\""),
    _honoured("return_token_ids", VLLM, "`prompt_token_ids` and `token_ids` on the response, in vLLM's places"),
    _honoured("return_tokens_as_token_ids", VLLM, "logprob tokens written `token_id:<id>`"),
    _honoured("stream", BOTH, "server-sent events, a chunk per token"),
    _honoured("stream_options", BOTH, "see the stream_options table"),
    _honoured("user", BOTH, "logged with the call's request id"),
    _refused("logprob_token_ids", VLLM, "not served: per-position logprobs of fixed ids"),
    _refused("bad_words", VLLM, "not served", []),
    _refused("watermarking", VLLM, "no watermark is configured", False),
    _honoured("structured_outputs", VLLM, "see the structured_outputs table; " + CONSTRAINED),
    _honoured("priority", VLLM, "lower runs first (default 0); needs `--scheduling-policy priority` (else only 0), "
              "and no more urgent than the API key's tenant may ask for (its `max_priority`)"),
    _refused("request_id", VLLM, "ids are the gateway's (send an `X-Request-Id` header to name a call in the logs)"),
    _refused("session_id", VLLM, "no session routing"),
    _honoured("cache_salt", VLLM, "a non-empty string: prompts share prefix-cache blocks only with requests of the "
              "same tenant and the same salt (a tenant's requests are salted with it already)"),
    _refused("kv_transfer_params", VLLM, "no disaggregated prefill"),
    _refused("ec_transfer_params", VLLM, "no encoder cache"),
    _refused("vllm_xargs", VLLM, "no extension arguments"),
    _refused("repetition_detection", VLLM, "no repetition detection"),
    _refused("thinking_token_budget", VLLM, "no reasoning parser"),
    _refused("stream_interval", VLLM, "a chunk goes out per token", 1),
    _refused("return_weight_versions", VLLM, "one weight version", False),
    _refused("routed_experts_prompt_start", VLLM, "no mixture-of-experts models", 0),
    _refused("return_token_offsets", VLLM, "only vLLM's render routes have it", False),
    _refused("mm_payload", VLLM, "text models only"),
    _refused("return_mm_kwargs", VLLM, "text models only"),
    _honoured("guided_json", VLLM, "vLLM's older name of structured_outputs.json (vLLM itself now ignores it)"),
    _honoured("guided_regex", VLLM, "vLLM's older name of structured_outputs.regex"),
    _honoured("guided_choice", VLLM, "vLLM's older name of structured_outputs.choice"),
    _honoured("guided_grammar", VLLM, "vLLM's older name of structured_outputs.grammar"),
    _refused("guided_decoding_backend", VLLM, "llguidance is the one backend", "auto", "llguidance", "guidance"),
    _refused("guided_whitespace_pattern", VLLM, "whitespace between JSON tokens is up to 16 characters, or none "
             "with structured_outputs.disable_any_whitespace"),
    _refused("logits_processors", VLLM, "removed from vLLM; no custom logits processors"),
)

COMPLETIONS = _table(
    _honoured("prompt", BOTH, "a string, a list of token ids, or a list of either (choices per prompt)"),
    _honoured("echo", BOTH, "each choice's text (and logprobs) starts with its prompt's"),
    _honoured("logprobs", BOTH, "k (0-20): each output token's logprob and the k likeliest"),
    _honoured("max_tokens", BOTH, "default 16, capped to the context left; 0 with echo answers the prompt alone"),
    _honoured("add_special_tokens", VLLM, "the tokenizer adds its special tokens to a text prompt (default true)"),
    _honoured("best_of", OPENAI, BEST_OF),
    _refused("suffix", BOTH, "no fill-in-the-middle", ""),
    _refused("prompt_embeds", VLLM, "prompts are text or token ids"),
    _honoured("response_format", VLLM, RESPONSE_FORMAT),
    *_SAMPLING,
)

CHAT = _table(
    _honoured("messages", BOTH, "any role the chat template takes; content a string or text parts; a `name` "
              "goes to the template"),
    _honoured("logprobs", BOTH, "each output token's logprob"),
    _honoured("top_logprobs", BOTH, "0-20 likeliest per token (needs logprobs)"),
    _honoured("max_completion_tokens", BOTH, "default: the context left"),
    _honoured("max_tokens", BOTH, "the older name of max_completion_tokens"),
    _honoured("add_generation_prompt", VLLM, "the template opens the assistant's turn (default true)"),
    _honoured("continue_final_message", VLLM, "the last message is continued, not closed (needs "
              "add_generation_prompt false)"),
    _honoured("add_special_tokens", VLLM, "special tokens added on top of the template's (default false)"),
    _honoured("chat_template_kwargs", VLLM, "more variables for the chat template (e.g. enable_thinking)"),
    _honoured("echo", VLLM, "the answer starts with the last message's content when that message has the "
              "answer's role"),
    _honoured("return_prompt_text", VLLM, "the rendered prompt as `prompt_text` on the response (first chunk)"),
    _honoured("safety_identifier", OPENAI, "logged with the call's request id, as `user`"),
    _honoured("best_of", OURS, BEST_OF),
    _honoured("response_format", BOTH, RESPONSE_FORMAT),
    _refused("include_reasoning", VLLM, "no reasoning parser: the answer holds what the model writes", True),
    _honoured("tools", BOTH, "functions the model may call (rendered by the chat template); their calls come back "
              "as `tool_calls`, in the format of `--tool-call-parser`"),
    _honoured("tool_choice", BOTH, "\"none\", \"auto\" (default with tools: text, or calls kept valid once opened), "
              "\"required\" or a named function (calls alone, constrained to the functions' schemas)"),
    _honoured("parallel_tool_calls", BOTH, "false: at most one call"),
    _refused("functions", OPENAI, "deprecated by OpenAI: send `tools`", []),
    _refused("function_call", OPENAI, "deprecated by OpenAI: send `tool_choice`", "none"),
    _refused("documents", VLLM, "no retrieval documents for the template"),
    _refused("chat_template", VLLM, "the model's own chat template only"),
    _refused("media_io_kwargs", VLLM, "text models only"),
    _refused("mm_processor_kwargs", VLLM, "text models only"),
    _refused("audio", OPENAI, "text models only"),
    _refused("modalities", OPENAI, "text models only", ["text"]),
    _refused("prediction", OPENAI, "no predicted outputs"),
    _refused("reasoning_effort", BOTH, "no reasoning models"),
    _refused("verbosity", OPENAI, "no verbosity control"),
    _refused("web_search_options", OPENAI, "no web search"),
    _refused("store", OPENAI, "chat completions are not stored", False),
    _refused("metadata", OPENAI, "chat completions are not stored", {}),
    _refused("service_tier", OPENAI, "one service tier", "auto", "default"),
    _refused("moderation", OPENAI, "no moderation"),
    _refused("prompt_cache_key", OPENAI, "the prefix cache finds shared prompts itself"),
    _refused("prompt_cache_options", OPENAI, "the prefix cache finds shared prompts itself"),
    _refused("prompt_cache_retention", OPENAI, "the prefix cache keeps blocks until they are reused"),
    *_SAMPLING,
)

STRUCTURED_OUTPUTS = _table(
    _honoured("json", VLLM, "a JSON schema (an object, or its text)"),
    _honoured("regex", VLLM, "a regular expression the whole output matches"),
    _honoured("choice", VLLM, "the output is one of these strings"),
    _honoured("grammar", VLLM, "a Lark or GBNF (llama.cpp's EBNF) grammar"),
    _honoured("json_object", VLLM, "any JSON object"),
    _honoured("disable_any_whitespace", VLLM, "JSON with no whitespace between its tokens"),
    _refused("disable_additional_properties", VLLM, "a schema says additionalProperties itself", False),
    _refused("whitespace_pattern", VLLM, "whitespace between JSON tokens is up to 16 characters, or none "
             "(disable_any_whitespace)"),
    _refused("structural_tag", VLLM, "send `tools`: the server writes the grammar of the model's calls"),
)

STREAM_OPTIONS = _table(
    _honoured("include_usage", BOTH, "a last chunk with the call's usage"),
    _honoured("continuous_usage_stats", VLLM, "every chunk carries its choice's usage so far"),
    _refused("include_obfuscation", OPENAI, "chunks carry no obfuscation padding", False),
)

TOKENIZE = _table(
    _honoured("model", VLLM, "the served model's id; another is a 404"),
    _honoured("prompt", VLLM, "text to tokenize"),
    _honoured("messages", VLLM, "chat messages, rendered by the chat template"),
    _honoured("add_special_tokens", VLLM, "default true for a prompt, false for messages"),
    _honoured("add_generation_prompt", VLLM, "messages: the template opens the assistant's turn (default true)"),
    _honoured("continue_final_message", VLLM, "messages: the last message is continued, not closed"),
    _honoured("chat_template_kwargs", VLLM, "messages: more variables for the chat template"),
    _honoured("return_token_strs", VLLM, "`token_strs` beside the ids (else null)"),
    _refused("chat_template", VLLM, "the model's own chat template only"),
    _honoured("tools", VLLM, "rendered by the chat template, as chat renders them"),
    _refused("response_format", VLLM, "a constraint changes no prompt token", {"type": "text"}),
    _refused("media_io_kwargs", VLLM, "text models only"),
    _refused("mm_processor_kwargs", VLLM, "text models only"),
)

DETOKENIZE = _table(
    _honoured("model", VLLM, "the served model's id; another is a 404"),
    _honoured("tokens", VLLM, "token ids to decode, special tokens written out"),
)

# vLLM's Responses request takes these fields of its chat request, meaning the same: they go on to the chat call.
RESPONSES_FROM_CHAT = ("top_k", "seed", "stop", "repetition_penalty", "ignore_eos", "skip_special_tokens",
                       "include_stop_str_in_output", "logit_bias", "structured_outputs", "chat_template_kwargs",
                       "priority", "cache_salt")


def _as_chat(by: str, *names: str) -> tuple[Field, ...]:
    """Chat's own fields, as another route defines them (`by`)."""
    return tuple(Field(f.name, by, f.meaning, f.refused, f.nothing) for f in (CHAT[name] for name in names))


RESPONSES = _table(
    *_as_chat(BOTH, "model", "temperature", "top_p", "user", "parallel_tool_calls", "service_tier", "prompt_cache_key"),
    *_as_chat(OPENAI, "safety_identifier", "moderation", "prompt_cache_options", "prompt_cache_retention"),
    _honoured("input", BOTH, "a string (the user's message) or items: messages (`input_text` parts, an assistant's "
              "`output_text`; a developer's goes to the template as the system's), `function_call` and "
              "`function_call_output`; other item and part types (images, files, reasoning, item references) are a "
              "400"),
    _honoured("instructions", BOTH, "the first message, the system's; not carried over by `previous_response_id` "
              "(as OpenAI)"),
    _honoured("max_output_tokens", BOTH, "default: the context left; an answer it cuts is `incomplete`"),
    _honoured("tools", BOTH, "function tools (`name`, `description`, `parameters`, `strict`), as chat's `tools`; "
              "other tool types are a 400"),
    _honoured("tool_choice", BOTH, "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\"}, as chat's"),
    _honoured("text", BOTH, "see the text table"),
    _honoured("stream", BOTH, "OpenAI's typed events, each with its `sequence_number`"),
    _honoured("store", BOTH, "default true: the response, its input and output are kept for "
              "`GET /v1/responses/{response_id}` and `previous_response_id`"),
    _honoured("background", BOTH, "the call answers at once (`queued`) and the response runs on; needs `store`"),
    _honoured("previous_response_id", BOTH, "the stored response whose conversation (its input and output, after "
              "those it continued) comes before this input"),
    _honoured("metadata", BOTH, "up to 16 string pairs (keys up to 64 characters, values up to 512), stored and "
              "echoed"),
    _honoured("include", BOTH, "values about items this server never writes (reasoning, hosted tools' results, "
              "images) include nothing; `message.output_text.logprobs` is a 400 (no logprobs here yet)"),
    _honoured("max_tool_calls", BOTH, "echoed: it caps calls to built-in tools, of which this server has none"),
    _refused("truncation", BOTH, "no truncation: an input longer than the context is a 400", "disabled"),
    _refused("top_logprobs", BOTH, "no logprobs on this route yet", 0),
    _refused("reasoning", BOTH, "no reasoning models", {}, {"effort": "none"}),
    _refused("prompt", BOTH, "no stored prompt templates"),
    _refused("stream_options", OPENAI, "events carry no obfuscation padding", {}, {"include_obfuscation": False}),
    _refused("conversation", OPENAI, "no conversation objects: continue a response with `previous_response_id`"),
    _refused("context_management", OPENAI, "no compaction", []),
    _refused("background_options", OPENAI, "one completion window", {}, {"completion_window": "soonest"}),
    _refused("access_programs", OPENAI, "no access programs"),
    _refused("image", OPENAI, "text models only"),
    *_as_chat(VLLM, *RESPONSES_FROM_CHAT, "request_id", "session_id", "media_io_kwargs", "mm_processor_kwargs",
              "vllm_xargs", "kv_transfer_params", "ec_transfer_params"),
    _refused("enable_response_messages", VLLM, "harmony (gpt-oss) messages only", False),
    _refused("previous_input_messages", VLLM, "harmony (gpt-oss) messages only: send `input` items"),
)

RESPONSES_TEXT = _table(
    _honoured("format", BOTH, "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
              "\"name\", \"schema\", \"strict\"}: " + CONSTRAINED),
    Field("verbosity", BOTH, CHAT["verbosity"].meaning, refused=True),
)

ANTHROPIC, ANTHROPIC_BETA = "Anthropic", "Anthropic (beta)"
CACHE_CONTROL = ("every prompt's full KV blocks are cached anyway, so a cache breakpoint asks for nothing more; a "
                 "`ttl` is refused: blocks stay until they are reused, not for a set time")
BLOCK_CACHE_CONTROL = "as the top-level `cache_control`: a breakpoint asks for nothing more; a `ttl` is refused"
NO_THINKING = "no extended thinking: the answer holds what the model writes"

_ANTHROPIC_PROMPT = (
    _honoured("model", ANTHROPIC, "required: the served model's id (`GET /v1/models`); another is a 404"),
    _honoured("messages", ANTHROPIC, "user, assistant and system turns (consecutive turns of a role joined, as "
              "Anthropic does; see the message and block tables): a user's tool results become `tool` messages, in "
              "order, before the turn's text; a last assistant turn is continued (prefill)"),
    _honoured("system", ANTHROPIC, "a string or text blocks: the first message, with the system role"),
    _honoured("tools", ANTHROPIC, "custom tools (see the tool table), rendered by the chat template; their calls "
              "come back as `tool_use` blocks, in the format of `--tool-call-parser`"),
    _refused("thinking", ANTHROPIC, NO_THINKING, {"type": "disabled"}),
    _refused("cache_control", ANTHROPIC, CACHE_CONTROL, {"type": "ephemeral"}),
    _refused("speed", ANTHROPIC, "one speed", "standard"),
    _refused("context_management", ANTHROPIC_BETA, "no context editing"),
    _refused("mcp_servers", ANTHROPIC_BETA, "no MCP connector", []),
    _refused("billing_policy", ANTHROPIC_BETA, "nothing is billed", {"type": "billing_policy", "bill_to": "self"}),
)

MESSAGES = _table(
    *_ANTHROPIC_PROMPT,
    _honoured("max_tokens", ANTHROPIC, "required: 1 up to the context left (0, Anthropic's cache warm-up, is a 400)"),
    _honoured("stop_sequences", ANTHROPIC, "strings that end the answer (cut from it); `stop_reason` "
              "\"stop_sequence\" and `stop_sequence` say which"),
    _honoured("stream", ANTHROPIC, "server-sent events as Anthropic sends them: message_start, ping, each content "
              "block's start, deltas and stop, message_delta, message_stop"),
    _honoured("temperature", ANTHROPIC, "0-1; 0 is greedy"),
    _honoured("top_p", ANTHROPIC, "(0, 1]"),
    _honoured("priority", VLLM, "as chat's: lower runs first, under `--scheduling-policy priority`"),
    _honoured("top_k", ANTHROPIC, "only the k likeliest tokens; 0 = off"),
    _honoured("tool_choice", ANTHROPIC, "see the tool_choice table; auto is the default with tools (text, or calls "
              "kept valid once opened); calls are constrained to the tools' schemas"),
    _honoured("metadata", ANTHROPIC, "see the metadata table"),
    _honoured("output_config", ANTHROPIC, "see the output_config table"),
    _refused("service_tier", ANTHROPIC, "one service tier (usage says `standard`)", "auto", "standard_only"),
    _refused("container", ANTHROPIC, "no code-execution containers"),
    _refused("diagnostics", ANTHROPIC, "no prompt-cache diagnostics"),
    _refused("inference_geo", ANTHROPIC, "inference runs where this server runs"),
    _refused("compaction", ANTHROPIC_BETA, "no compaction"),
    _refused("fallbacks", ANTHROPIC_BETA, "one model, no fallbacks", []),
    _refused("fallback_credit_token", ANTHROPIC_BETA, "nothing is refused or billed, so there is no credit"),
    _refused("thread", ANTHROPIC_BETA, "no server-held conversation state: send the whole conversation"),
)

COUNT_TOKENS = _table(
    *_ANTHROPIC_PROMPT,
    _honoured("tool_choice", ANTHROPIC, "checked as /v1/messages checks it; changes no prompt token (the template gets "
              "the tools whatever the choice)"),
    _honoured("output_config", ANTHROPIC, "checked as /v1/messages checks it; a constraint adds no prompt token"),
    _honoured("compaction", ANTHROPIC_BETA, "changes no count, as Anthropic's own count ignores it: the count is of "
              "`messages` as sent"),
)

# The objects inside a Messages body, each checked by its own table as the routes' bodies are.
ANTHROPIC_MESSAGE = _table(
    _honoured("role", ANTHROPIC, "\"user\", \"assistant\" or \"system\""),
    _honoured("content", ANTHROPIC, "a string, or blocks: text, tool_use (an assistant's), tool_result (a user's); "
              "other types (images, documents, thinking, server tools' blocks) are a 400 naming them"),
    _refused("clear_at", ANTHROPIC_BETA, "a system message stays in front of the model", "never"),
    _refused("output_config", ANTHROPIC_BETA, "no per-turn output configuration", {}),
)

TEXT_BLOCK = _table(
    _honoured("type", ANTHROPIC, "\"text\""),
    _honoured("text", ANTHROPIC, "a turn's text blocks are joined as chat joins text parts"),
    _refused("cache_control", ANTHROPIC, BLOCK_CACHE_CONTROL, {"type": "ephemeral"}),
    _refused("citations", ANTHROPIC, "no citations", []),
)

TOOL_USE_BLOCK = _table(
    _honoured("type", ANTHROPIC, "\"tool_use\""),
    _honoured("id", ANTHROPIC, "the call's id (the one this server gave it): the template gets it, as chat's "
              "`tool_calls[].id`"),
    _honoured("name", ANTHROPIC, "the tool called"),
    _honoured("input", ANTHROPIC, "the call's input, an object: the template gets it as the call's arguments"),
    _refused("cache_control", ANTHROPIC, BLOCK_CACHE_CONTROL, {"type": "ephemeral"}),
    _refused("caller", ANTHROPIC, "the model calls tools itself (no programmatic tool calling)", {"type": "direct"}),
    _refused("toolset_name", ANTHROPIC, "no MCP toolsets"),
)

TOOL_RESULT_BLOCK = _table(
    _honoured("type", ANTHROPIC, "\"tool_result\""),
    _honoured("tool_use_id", ANTHROPIC, "the call it answers: a `tool` message with that `tool_call_id`"),
    _honoured("content", ANTHROPIC, "a string or text blocks; images, documents and search results are a 400"),
    _honoured("is_error", ANTHROPIC, "true: the template reads `Error: ` before the result (chat templates have no "
              "error flag)"),
    _refused("cache_control", ANTHROPIC, BLOCK_CACHE_CONTROL, {"type": "ephemeral"}),
    _refused("toolset_name", ANTHROPIC, "no MCP toolsets"),
)

ANTHROPIC_TOOL = _table(
    _honoured("type", ANTHROPIC, "\"custom\" or absent; a server tool's type (bash, code execution, web search, ...) "
              "is a 400 naming it"),
    _honoured("name", ANTHROPIC, "as chat's function name: 1-64 letters, digits, _ . or -"),
    _honoured("description", ANTHROPIC, "rendered by the chat template"),
    _honoured("input_schema", ANTHROPIC, "a JSON schema of an object: rendered by the template, and the calls' input "
              "is constrained to it"),
    _honoured("strict", ANTHROPIC, "calls are constrained to `input_schema` either way"),
    _honoured("eager_input_streaming", ANTHROPIC, "input streams as it is written either way"),
    _refused("cache_control", ANTHROPIC, BLOCK_CACHE_CONTROL, {"type": "ephemeral"}),
    _refused("defer_loading", ANTHROPIC, "no tool search: every tool is rendered", False),
    _refused("input_examples", ANTHROPIC, "the chat template renders no input examples", []),
    _refused("allowed_callers", ANTHROPIC, "the model calls tools itself (no programmatic tool calling)", ["direct"]),
)

ANTHROPIC_TOOL_CHOICE = _table(
    _honoured("type", ANTHROPIC, "\"auto\" (chat's auto), \"any\" (chat's required), \"tool\" (a named function) or "
              "\"none\""),
    _honoured("name", ANTHROPIC, "type \"tool\": the tool whose call alone comes back"),
    _honoured("disable_parallel_tool_use", ANTHROPIC, "true: at most one call (chat's `parallel_tool_calls: false`)"),
)

ANTHROPIC_METADATA = _table(
    _honoured("user_id", ANTHROPIC, "logged with the call's request id, as chat's `user`"),
)

OUTPUT_CONFIG = _table(
    _honoured("format", ANTHROPIC, "see the output_config.format table"),
    _refused("effort", ANTHROPIC, "no reasoning models"),
    _refused("task_budget", ANTHROPIC_BETA, "no task budgets"),
)

OUTPUT_FORMAT = _table(
    _honoured("type", ANTHROPIC, "\"json_schema\""),
    _honoured("schema", ANTHROPIC, "a JSON schema: " + CONSTRAINED),
)

ROUTES = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, "stream_options": STREAM_OPTIONS,
          "structured_outputs": STRUCTURED_OUTPUTS,
          "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE, "/v1/responses": RESPONSES, "text": RESPONSES_TEXT,
          "/v1/messages": MESSAGES, "/v1/messages/count_tokens": COUNT_TOKENS,
          "/v1/messages: message": ANTHROPIC_MESSAGE, "/v1/messages: text block": TEXT_BLOCK,
          "/v1/messages: tool_use block": TOOL_USE_BLOCK, "/v1/messages: tool_result block": TOOL_RESULT_BLOCK,
          "/v1/messages: tool": ANTHROPIC_TOOL, "/v1/messages: tool_choice": ANTHROPIC_TOOL_CHOICE,
          "/v1/messages: metadata": ANTHROPIC_METADATA, "/v1/messages: output_config": OUTPUT_CONFIG,
          "/v1/messages: output_config.format": OUTPUT_FORMAT}


def markdown() -> str:
    """The README's field list: one table per route (and one for stream_options)."""
    out = []
    for route, table in ROUTES.items():
        out += [f"**`{route}`**\n", "| field | defined by | pagedserve |", "| --- | --- | --- |"]
        for f in sorted(table.values(), key=lambda f: (f.refused, f.name)):
            what = f"refused (400){' unless ' + _nothing(f) if f.nothing[1:] else ''}: {f.meaning}" if f.refused \
                else f.meaning
            out.append(f"| `{f.name}` | {f.defined_by} | {what} |")
        out.append("")
    return "\n".join(out)


def _nothing(f: Field) -> str:
    return " or ".join(f"`{json.dumps(v)}`" for v in f.nothing[1:])


if __name__ == "__main__":
    print(markdown())
