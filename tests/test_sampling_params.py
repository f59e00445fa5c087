"""Each sampling-parameter rule rejects a bad value with a message naming the parameter and range."""
from __future__ import annotations

import math

import pytest

from shared.sampling import ParamError, SamplingParams, finish_reason


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, r"n must be in \[1, 128\]; got 0"),
    ("n", 129, r"n must be in \[1, 128\]"),
    ("max_tokens", 0, r"max_tokens must be at least 1; got 0"),
    ("min_tokens", 17, r"min_tokens must be in \[0, 16\]; got 17"),
    ("temperature", -0.1, r"temperature must be in \[0.0, 2.0\]"),
    ("temperature", 2.5, r"temperature must be in \[0.0, 2.0\]"),
    ("temperature", math.nan, r"temperature must be in \[0.0, 2.0\]; got nan"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, r"top_k must be -1 or 0 \(off\) or at least 1"),
    ("min_p", 1.5, r"min_p must be in \[0.0, 1.0\]"),
    ("seed", -1, r"seed must be in \[0, 9223372036854775807\]"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2.0, 2.0\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 2\]"),
    ("repetition_penalty", 3.0, r"repetition_penalty must be in \(0, 2\]"),
    ("stop_token_ids", [1, -4], r"stop_token_ids must be token ids of 0 or more; got -4"),
    ("logprobs", 21, r"logprobs must be in \[0, 20\]"),
    ("logprobs", -1, r"logprobs must be in \[0, 20\]"),
    ("logit_bias", [(5, 100.5)], r"logit_bias maps token ids to biases in \[-100, 100\]; got 5: 100.5"),
    ("logit_bias", [(-1, 1.0)], r"logit_bias maps token ids"),
    ("allowed_token_ids", [3, -2], r"allowed_token_ids must be token ids of 0 or more; got -2"),
])
def test_rule(field, value, message):
    with pytest.raises(ParamError, match=message) as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.param == field


def test_beam_search_takes_no_bias_or_allowed_tokens():
    for name, value in (("logit_bias", [(5, 1.0)]), ("allowed_token_ids", [5])):
        with pytest.raises(ParamError, match=f"{name} does not apply to beam search") as info:
            SamplingParams(beam_width=2, **{name: value}).validate()
        assert info.value.param == name


def test_defaults_and_edges_are_valid():
    SamplingParams().validate()
    SamplingParams(n=128, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, seed=0, logprobs=20,
                   repetition_penalty=2.0, presence_penalty=-2.0, min_tokens=16).validate()
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy


def test_finish_reason():
    p = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert finish_reason(p, [], 5, 100, [2]) is None
    assert finish_reason(p, [5], 6, 100, [2]) is None
    assert finish_reason(p, [5, 2], 7, 100, [2]) == "stop"
    assert finish_reason(p, [7], 6, 100, [2]) == "stop"
    assert finish_reason(p, [5, 5, 5], 8, 100, [2]) == "length"
    assert finish_reason(p, [5], 100, 100, [2]) == "length"
    assert finish_reason(SamplingParams(ignore_eos=True), [2], 6, 100, [2]) is None
    assert finish_reason(SamplingParams(min_tokens=2), [2], 6, 100, [2]) is None
