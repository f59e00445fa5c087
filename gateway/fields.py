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
    _refused("priority", VLLM, "one priority for all requests yet", 0),
    _refused("request_id", VLLM, "ids are the gateway's (send an `X-Request-Id` header to name a call in the logs)"),
    _refused("session_id", VLLM, "no session routing"),
    _refused("cache_salt", VLLM, "one prefix cache for all requests yet"),
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

ROUTES = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, "stream_options": STREAM_OPTIONS,
          "structured_outputs": STRUCTURED_OUTPUTS,
          "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE}


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
