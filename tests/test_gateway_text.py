"""The gateway's text path without HTTP: incremental detokenization (oracle: the tokenizer's own decode),
stop strings (oracle: a direct search of the whole text), the per-request tracker, SSE framing."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import sse
from gateway.detokenizer import IncrementalDetokenizer
from gateway.generation import RequestTracker
from gateway.model import Tokenizer
from gateway.request_model import ChatTemplate
from gateway.stop import StopStrings
from shared.protocol import Assignment, TokenOutput

MULTIBYTE = ["Größe, café, naïve — 東京 🚀 and 🚀🚀 again", "東京東京東京", "🚀", "a 🚀 b 東 c é"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """The oracle: transformers' own tokenizer of the checkpoint."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def stream(tok: Tokenizer, prompt_ids: list[int], ids: list[int], shortcut: bool = True) -> list[str]:
    """The deltas, as the gateway makes them (`shortcut`: plain ASCII tokens skip decoding)."""
    detok = IncrementalDetokenizer.after_prompt(tok.decode, prompt_ids, tok.appended_text if shortcut else None)
    return [detok.add(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_deltas_join_to_decode_and_never_split_a_character(tok, hf, text):
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the text must split a character over tokens"
    deltas = stream(tok, tok.encode("Say:"), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(5, 511), max_size=40), st.sampled_from(["", "Hi", "東京"]))
def test_any_token_sequence_detokenizes_like_decode(tok, ids, prompt):
    prompt_ids = tok.encode(prompt) if prompt else []
    assert "".join(stream(tok, prompt_ids, ids)) == tok.decode(ids)


# Characters cut short, lone continuation bytes, an overlong form, a surrogate, past U+10FFFF, bytes never in UTF-8.
TRICKY_BYTES = [b"\xe6\x9d", b"\xe6\x9d\xb1", b"\x80", b"\xbf\xbf", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                b"\xf5\xff", b"\xf0\x9f\x9a", "🚀".encode(), b"a", b"!", b" ", b"\n"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 515) | st.sampled_from(TRICKY_BYTES), max_size=30),
       st.lists(st.integers(0, 511) | st.sampled_from(TRICKY_BYTES), max_size=4))
def test_a_plain_ascii_token_after_all_was_sent_is_its_own_delta_as_decoding_finds(tok, output, prompt):
    # Oracle: the same detokenizer decoding every token (vLLM's method). Bytes stand for their byte tokens.
    of_byte = {b[0]: t for t in range(tok.vocab_size) if t not in tok.added and len(b := tok.token_bytes(t)) == 1}

    def ids(items: list[int | bytes]) -> list[int]:
        return [t for item in items for t in ([item] if isinstance(item, int) else [of_byte[b] for b in item])]

    assert stream(tok, ids(prompt), ids(output)) == stream(tok, ids(prompt), ids(output), shortcut=False)
    assert [t for t in range(tok.vocab_size) if tok.appended_text(t) is not None], "the shortcut is taken"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 511), max_size=12), st.booleans())
def test_the_gateways_decode_is_transformers_decode(tok, hf, ids, skip_special_tokens):
    assert tok.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=30))
def test_logprob_tokens_spell_the_text_byte_for_byte(tok, hf, text):
    # Oracle: the text's own UTF-8 bytes.
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    for t in ids:  # whole characters read as themselves, anything else as `bytes:...`, never U+FFFD
        try:
            alone = tok.token_bytes(t).decode()
        except UnicodeDecodeError:
            alone = None
        assert tok.token_text(t) == alone if alone is not None else tok.token_text(t).startswith("bytes:")


def test_special_tokens_are_skipped_in_text(tok, hf):
    ids = hf("hello<|im_end|> world", add_special_tokens=False)["input_ids"]
    assert "".join(stream(tok, [], ids)) == tok.decode(ids) == "hello world"


def first_stop(text: str, chunks: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Oracle: after each chunk, search the whole text so far; cut at the earliest match."""
    seen = ""
    for chunk in chunks:
        seen += chunk
        hits = [(seen.find(s), s) for s in stops if s in seen]
        if hits:
            i, s = min(hits)
            return seen[:i], s
    return seen, None


@given(st.lists(st.text("ab東🚀", max_size=6), max_size=12), st.lists(st.text("ab東🚀", min_size=1, max_size=4),
                                                                   max_size=3))
def test_stop_strings_match_a_whole_text_search(chunks, stops):
    checker = StopStrings(stops)
    sent, matched = "", None
    for chunk in chunks:
        out, matched = checker.feed(chunk)
        expected_prefix = first_stop("".join(chunks), chunks, stops)[0]
        sent += out
        assert expected_prefix.startswith(sent), "released text must never be taken back"
        if matched:
            break
    if matched is None:
        sent += checker.flush()
    assert (sent, matched) == first_stop("".join(chunks), chunks, stops)


def test_stop_string_split_over_deltas_is_held_back_then_dropped():
    checker = StopStrings(["STOP"])
    assert checker.feed("abc ST") == ("abc ", None)
    assert checker.feed("O") == ("", None)
    assert checker.feed("Pxyz") == ("", "STOP")


def outputs(rid: str, sample: int, ids: list[int], finish: str = "length") -> list[TokenOutput]:
    return [TokenOutput(rid, sample, i, t, logprob=-0.5, top_logprobs=[(t, -0.5)],
                        finish_reason=finish if i == len(ids) - 1 else None, worker_id="w0", epoch=1)
            for i, t in enumerate(ids)]


def placed_tracker(rid: str, n: int, prompt: list[int], tok: Tokenizer, stops: list[str]) -> RequestTracker:
    """A tracker whose request the scheduler has placed on worker w0 in epoch 1."""
    made = RequestTracker(rid, n, 64, prompt, tok.decode, stops, appended_text=tok.appended_text)
    made.apply(Assignment(rid, "w0", 1))
    return made


def test_tracker_dedupes_interleaves_samples_and_applies_stop_strings(tok, hf):
    a = hf("one two three", add_special_tokens=False)["input_ids"]
    b = hf("東京 🚀 END rest", add_special_tokens=False)["input_ids"]
    tracker = placed_tracker("r", 2, tok.encode("Q"), tok, ["END"])
    # Sample 1 is still running on the bus when its text hits the stop string.
    stream_a, stream_b = outputs("r", 0, a), outputs("r", 1, b)[:-1]
    entries = [e for i in range(max(len(a), len(b))) for e in (stream_a[i:i + 1] + stream_b[i:i + 1])]
    texts = ["", ""]
    for entry in entries + entries:  # every entry twice, as a resumed request may repeat them
        for delta in tracker.apply(entry):
            texts[delta.sample_index] += delta.text
    assert texts == ["one two three", "東京 🚀 "]
    assert [s.finish_reason for s in tracker.samples] == ["length", "stop"]
    assert tracker.samples[1].stop_reason == "END"
    assert len(tracker.samples[0].token_ids) == len(a)
    assert tracker.finished and tracker.needs_abort, "sample 1 ended on a stop string, not on the bus"


def test_tracker_leaves_out_the_text_of_a_stop_token_and_ends_on_a_request_error(tok, hf):
    ids = hf("hi there</s>", add_special_tokens=False)["input_ids"]
    tracker = placed_tracker("r", 1, [], tok, [])
    text = "".join(d.text for e in outputs("r", 0, ids, finish="stop") for d in tracker.apply(e))
    assert text == "hi there" and not tracker.needs_abort
    failing = placed_tracker("q", 1, [], tok, [])
    assert failing.apply(TokenOutput("q", -1, 0, 0, finish_reason="error", error="too long")) == []
    assert failing.finished and failing.error == "too long" and not failing.needs_abort
    assert failing.apply(TokenOutput("other", 0, 0, 5)) == []


def test_tracker_ends_running_samples_when_the_scheduler_ends_the_request(tok, hf):
    ids = hf("one two", add_special_tokens=False)["input_ids"]
    tracker = placed_tracker("r", 2, [], tok, [])
    for e in outputs("r", 0, ids, finish="stop"):
        tracker.apply(e)
    tracker.apply(outputs("r", 1, ids)[0])
    deltas = tracker.apply(TokenOutput("r", -1, 0, -1, finish_reason="length"))
    assert [(d.sample_index, d.finish_reason) for d in deltas] == [(1, "length")]
    assert [s.finish_reason for s in tracker.samples] == ["stop", "length"]
    assert tracker.finished and tracker.error is None and not tracker.needs_abort


def test_sse_event_is_one_data_line_of_json():
    frame = sse.event({"text": "東京\n🚀", "n": 1})
    assert frame.endswith(b"\n\n") and frame.count(b"\n") == 2 and frame.startswith(b"data: ")
    assert json.loads(frame[len(b"data: "):]) == {"text": "東京\n🚀", "n": 1}
    assert sse.DONE == b"data: [DONE]\n\n"


@given(st.text(max_size=20) | st.sampled_from(["\x00", '"', "\\u0000", "\u2028\x7f\x1f", "東京\n🚀"]))
def test_a_text_event_fills_in_to_the_whole_event_encoded(text):
    # Oracle: encoding the whole event with its text.
    def chunk(t: str) -> dict:
        return {"id": "cmpl-1", "model": 'a "quoted" \\ model', "choices": [{"index": 0, "delta": {"content": t},
                                                                       "logprobs": None, "finish_reason": None}]}
    assert sse.TextEvent.around(chunk(sse.TEXT)).event(text) == sse.event(chunk(text))
    assert sse.TextEvent.around({"a": sse.TEXT, "b": sse.TEXT}) is None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40) | st.sampled_from(["<s>hi</s>", "a<|im_start|>b<|im_end|>", " lead", "東京 🚀"]),
       st.booleans())
def test_the_gateways_encode_is_transformers_encode(tok, hf, text, add_special_tokens):
    assert tok.encode(text, add_special_tokens) == hf(text, add_special_tokens=add_special_tokens)["input_ids"]


def test_the_tokenizer_loads_without_transformers_and_chat_renders_as_transformers_does(tiny_model_dir, hf):
    code = ("import sys; from pathlib import Path; from gateway.model import Tokenizer; "
            f"t = Tokenizer.load(Path({str(tiny_model_dir)!r})); t.encode('hi'); t.decode([5, 6]); "
            "print('transformers' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False", "starting the gateway's tokenizer imports no transformers"
    tok = Tokenizer.load(tiny_model_dir)
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京?"},
              {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "and?"}]]
    for messages in chats:
        for prompt in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            rendered = tok.render_chat(messages, ChatTemplate(add_generation_prompt=prompt))
            assert rendered.text == expected
            assert rendered.token_ids == hf(expected, add_special_tokens=False)["input_ids"]
    ids = list(range(0, 512, 7))
    assert tok.token_strs(ids) == hf.convert_ids_to_tokens(ids) and tok.vocab_size == len(hf)
    info = tok.info(2048)
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (hf.bos_token, hf.eos_token, hf.pad_token)
