"""Issue 71: no request body is ever answered 500. Hypothesis draws request bodies for
/v1/completions, /v1/chat/completions and /v1/responses (OpenAI's and vLLM's fields with legal, odd and
wrong values, unknown keys, nested junk) and sends them to a server of the bundled
model: every answer is a 200 or a 4xx whose error says what is wrong, and the engine is
empty afterwards. Bounded: 300 small requests per endpoint, about 40 s."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import post  # noqa: E402
from test_serve import NAME, tiny_llm  # noqa: E402

import minillm.structured.serve  # noqa: E402,F401  chapter 11's fields and tools
from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=8)
SMALL = st.integers(-1, 6)
TEXT = st.text(max_size=40)
IDS = st.lists(st.integers(-3, 600), max_size=12)
SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 5}}}
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "x"]),
                              "function": st.fixed_dictionaries(
                                  {"name": st.sampled_from(["f", "g", "a b"])},
                                  optional={"parameters": st.one_of(
                                      st.just(SCHEMA), st.just(SCHEMA), JUNK)})})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "system", "assistant", "tool", "bot"])},
    optional={"content": st.one_of(TEXT, TEXT, st.none(), JUNK, st.just(
                  [{"type": "text", "text": "hi"}])),
              "tool_calls": st.one_of(JUNK, st.just([{"id": "c", "type": "function",
                                                      "function": {"name": "f",
                                                                   "arguments": "{}"}}])),
              "tool_call_id": st.one_of(TEXT, JUNK), "refusal": st.one_of(
                  st.none(), TEXT), "name": TEXT})


def field(*legal):
    """A field's value: legal or odd most of the time, junk now and then."""
    return st.one_of(*legal, *legal, *legal, JUNK)


COMMON = {
    "model": field(st.just(NAME)), "max_tokens": field(SMALL),
    "n": field(st.integers(0, 3)), "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-0.5, 1.5)), "top_k": field(SMALL),
    "stop": field(TEXT, st.lists(TEXT, max_size=3)),
    "seed": field(st.integers(-5, 2**64)), "stream": field(st.booleans()),
    "stream_options": field(st.just({"include_usage": True}), st.just(
        {"continuous_usage_stats": True})),
    "logit_bias": field(st.dictionaries(st.sampled_from(["1", "5", "x", "-1"]),
                                        st.floats(-200, 200), max_size=3)),
    "min_tokens": field(SMALL), "stop_token_ids": field(IDS),
    "response_format": field(st.sampled_from([
        {"type": "json_object"}, {"type": "text"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        {"type": "json_object", "schema": SCHEMA}])),
    "structured_outputs": field(st.sampled_from([
        {"choice": ["a", "b"]}, {"regex": "[a-c]{1,3}"}, {"json": {"type": "integer"}},
        {"regex": "(" * 300 + ")" * 300}, {"json": {"type": {"a": 1}}},
        {"json": {"allOf": 5}}, {"grammar": "root ::= 'a'"}])),
    "guided_choice": field(st.lists(TEXT, max_size=3)),
    "prompt_logprobs": field(SMALL), "user": field(TEXT), "cache_salt": field(TEXT),
    "presence_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 3)),
    "ignore_eos": field(st.booleans()), "include_stop_str_in_output": field(
        st.booleans()),
}
COMPLETIONS = {**COMMON, "prompt": field(TEXT, IDS, st.lists(TEXT, max_size=3),
                                         st.lists(IDS, max_size=3)),
               "echo": field(st.booleans()), "logprobs": field(SMALL),
               "suffix": field(TEXT), "best_of": field(SMALL)}
CHAT = {**COMMON, "messages": field(st.lists(MESSAGE, min_size=1, max_size=4)),
        "tools": field(st.lists(TOOL, max_size=3)),
        "tool_choice": field(st.sampled_from(["auto", "none", "required", {
            "type": "function", "function": {"name": "f"}}, {
            "type": "function", "function": "f"}])),
        "parallel_tool_calls": field(st.booleans()),
        "logprobs": field(st.booleans()), "top_logprobs": field(SMALL),
        "max_completion_tokens": field(SMALL)}
RTOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "x"]),
                               "name": st.sampled_from(["f", "g", "a b"])},
                              optional={"parameters": st.one_of(st.just(SCHEMA), JUNK),
                                        "strict": field(st.booleans())})
ITEM = st.one_of(MESSAGE, st.fixed_dictionaries(
    {"type": st.sampled_from(["function_call", "function_call_output", "message",
                              "reasoning"])},
    optional={"call_id": field(TEXT), "name": field(st.just("f")),
              "arguments": field(st.just("{}"), TEXT), "output": field(TEXT),
              "role": field(st.just("user")), "content": field(TEXT, st.just(
                  [{"type": "input_text", "text": "hi"}]))}))
RESPONSES = {
    "model": field(st.just(NAME)), "input": field(TEXT, st.lists(ITEM, max_size=4)),
    "instructions": field(TEXT), "max_output_tokens": field(SMALL),
    "temperature": field(st.floats(-1, 3)), "top_p": field(st.floats(-0.5, 1.5)),
    "stream": field(st.booleans()), "store": field(st.booleans()),
    "tools": field(st.lists(RTOOL, max_size=3)),
    "tool_choice": field(st.sampled_from(["auto", "none", "required", {
        "type": "function", "name": "f"}, {"type": "function"}])),
    "parallel_tool_calls": field(st.booleans()),
    "text": field(st.sampled_from([
        {"format": {"type": "text"}}, {"format": {"type": "json_object"}},
        {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
        {"format": {"type": "json_schema"}}, {"verbosity": "low"}])),
    "include": field(st.lists(st.sampled_from(["message.output_text.logprobs", "x"]),
                              max_size=2)),
    "top_logprobs": field(SMALL), "previous_response_id": field(TEXT),
    "truncation": field(st.sampled_from(["auto", "disabled"])),
    "reasoning": field(st.just({"effort": "low"})), "metadata": field(
        st.dictionaries(TEXT, TEXT, max_size=3)), "user": field(TEXT),
}
BASE = {"/v1/completions": {"model": NAME, "prompt": "ROMEO:", "max_tokens": 3},
        "/v1/chat/completions": {"model": NAME, "max_tokens": 3, "messages": [
            {"role": "user", "content": "What news?"}]},
        "/v1/responses": {"model": NAME, "input": "What news?",
                          "max_output_tokens": 3}}


def bodies(path: str, fields: dict):
    """A valid body with up to three fields changed (each to a legal, odd or wrong
    value), and now and then a key nobody knows."""
    changed = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}))
    unknown = st.one_of(st.just({}), st.just({}), st.dictionaries(
        st.text(max_size=10), JUNK, max_size=2))
    return st.tuples(changed, unknown).map(
        lambda t: {**t[1], **BASE[path], **t[0]})


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm(max_num_seqs=4, max_model_len=256)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    blocks = llm.engine.kv.blocks
    assert blocks.num_free == blocks.num_blocks


def check(url: str, path: str, body: dict) -> None:
    reply = post(url, path, body)
    assert reply.status_code < 500, (reply.status_code, json.dumps(body)[:400],
                                     reply.text[:400])
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert error["message"], reply.text


FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=bodies("/v1/completions", COMPLETIONS))
def test_no_completions_body_is_a_500(served, body):
    check(served[0], "/v1/completions", body)


@FUZZ
@given(body=bodies("/v1/chat/completions", CHAT))
def test_no_chat_body_is_a_500(served, body):
    check(served[0], "/v1/chat/completions", body)


@FUZZ
@given(body=bodies("/v1/responses", RESPONSES))
def test_no_responses_body_is_a_500(served, body):
    check(served[0], "/v1/responses", body)
