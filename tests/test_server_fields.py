"""No request field is accepted and silently ignored (issue 53): OpenAI's and vLLM's
request fields, walked on both endpoints. Each one the server acts on answers 200; each
one it does not is a 400 that names it, before any work. A value that changes nothing
(store=false, parallel_tool_calls without tools) is accepted; the same field asking for
something (store=true) is refused."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from test_serve import NAME, tiny_llm, wait_idle  # noqa: E402

OK, NO = 200, 400
BOTH = [  # (field, value, status) on both endpoints
    ("n", 2, OK), ("temperature", 0.5, OK), ("top_p", 0.9, OK), ("stop", ["\n"], OK),
    ("seed", 3, OK), ("presence_penalty", 0.5, OK), ("frequency_penalty", 0.5, OK),
    ("logit_bias", {"5": 1}, OK), ("user", "u-1", OK), ("metadata", {"k": "v"}, OK),
    ("store", False, OK), ("store", True, NO), ("service_tier", "auto", OK),
    ("service_tier", "flex", NO), ("parallel_tool_calls", False, OK),
    ("best_of", 3, NO), ("top_k", 5, OK), ("min_p", 0.1, OK),
    ("repetition_penalty", 1.2, OK), ("min_tokens", 1, OK), ("ignore_eos", True, OK),
    ("stop_token_ids", [5], OK), ("skip_special_tokens", False, OK),
    ("include_stop_str_in_output", True, OK),
    ("structured_outputs", {"choice": ["yes", "no"]}, OK),
    ("guided_choice", ["yes", "no"], OK), ("guided_regex", "[a-z]{3}", OK),
    ("guided_json", {"type": "object"}, OK), ("guided_grammar", 'root ::= "a"', OK),
    ("response_format", {"type": "json_object"}, OK),
    ("stream_options", {"include_usage": True}, NO),  # without stream=true
    # vLLM's, not implemented here
    ("use_beam_search", True, NO), ("length_penalty", 0.5, NO),
    ("truncate_prompt_tokens", 8, NO), ("allowed_token_ids", [5, 6], NO),
    ("bad_words", ["x"], NO), ("spaces_between_special_tokens", False, NO),
    ("guided_decoding_backend", "xgrammar", NO), ("guided_whitespace_pattern", " ", NO),
    ("priority", 1, NO), ("request_id", "r-1", NO), ("logits_processors", ["x"], NO),
    ("return_tokens_as_token_ids", True, NO), ("cache_salt", "s", OK),
    ("cache_salt", "", NO), ("cache_salt", 7, NO),
    ("vllm_xargs", {"a": 1}, NO), ("no_such_field", 1, NO),
]
COMPLETIONS = [("echo", True, OK), ("logprobs", 2, OK), ("prompt_logprobs", 1, OK),
               ("max_tokens", 4, OK), ("suffix", "x", NO),
               ("tools", [{"type": "function", "function": {"name": "f"}}], NO),
               ("tool_choice", "required", NO)]
CHAT = [("logprobs", True, OK), ("max_completion_tokens", 4, OK), ("functions", [
    {"name": "f", "parameters": {}}], NO), ("function_call", "auto", NO),
        ("modalities", ["text", "audio"], NO), ("audio", {"voice": "x"}, NO),
        ("reasoning_effort", "low", NO), ("prediction", {"type": "content"}, NO),
        ("web_search_options", {}, NO), ("add_generation_prompt", False, NO),
        ("chat_template", "{{ x }}", NO), ("documents", [{"a": "b"}], NO),
        ("tools", [{"type": "function", "function": {"name": "f"}}], OK),
        ("tool_choice", "none", OK), ("tool_choice", "auto", OK),
        ("tool_choice", "required", NO)]  # required needs tools
CASES = ([("completions",) + c for c in BOTH + COMPLETIONS]
         + [("chat",) + c for c in BOTH + CHAT])


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm(max_num_seqs=4)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm.engine
    assert not llm.engine.requests


@pytest.mark.parametrize("endpoint, field, value, status", CASES,
                         ids=[f"{c[0]}-{c[1]}-{json.dumps(c[2])[:12]}" for c in CASES])
def test_every_field_is_acted_on_or_refused(served, endpoint, field, value, status):
    url, engine = served
    body = ({"prompt": "ROMEO:\n"} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    body = {"model": NAME, "max_tokens": 4, "temperature": 0, **body, field: value}
    if field in ("structured_outputs", "response_format") or field.startswith(
            "guided_"):
        body.pop("max_tokens")  # the grammar ends the answer
        body["max_tokens"] = 8
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    if status == NO:
        assert r.json()["error"]["param"].split(".")[0] == field, r.text
        assert wait_idle(url) and not engine.requests  # refused before any work


def test_a_guided_field_constrains_the_answer(served):
    url, _ = served
    for field, value in [("guided_choice", ["yes", "no"]),
                         ("structured_outputs", {"choice": ["yes", "no"]})]:
        r = httpx.post(url + "/v1/completions", json={
            "model": NAME, "prompt": "ROMEO:\n", "max_tokens": 8, field: value})
        assert r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def test_two_fields_asking_for_one_constraint_are_refused(served):
    url, _ = served
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": "A", "guided_regex": "a+",
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "both" in r.json()["error"]["message"], r.text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served):
    url, _ = served
    body = {"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 5, "temperature": 0,
            "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 2
    assert events[-1]["usage"]["completion_tokens"] == 5
    bad = httpx.post(url + "/v1/completions", json={
        **body, "stream_options": {"continuous_usage_stats": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options"


def test_a_message_key_the_server_would_drop_is_refused(served):
    url, _ = served
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi", "mood": "x"}]})
    assert r.status_code == 400 and "messages.0" in r.json()["error"]["param"]
    ok = httpx.post(url + "/v1/chat/completions", json={
        "model": NAME, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("schema, named", [
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf"),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "uniqueItems at properties.tags"),
    ({"not": {"type": "integer"}}, "not")])
def test_a_schema_keyword_xgrammar_would_drop_is_a_400(served, schema, named):
    """Before: {"allOf": [...]} answered 200 with JSON that broke the schema (xgrammar
    compiles it and enforces only the first member)."""
    url, engine = served
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": "A", "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text
    assert wait_idle(url) and not engine.requests


def test_a_property_named_like_a_keyword_is_not_one():
    from minillm.structured.backends import unenforced
    schema = {"type": "object", "properties": {"not": {"type": "integer"},
                                               "contains": {"type": "string"}},
              "allOf": [{"required": ["not"]}]}
    assert unenforced(schema) is None
    assert unenforced({"$defs": {"x": {"if": {}}}, "$ref": "#/$defs/x"}) == "if at $defs.x"


def test_a_truncated_body_is_a_400_that_says_so(served):
    """Before: the error named param "28" (a character position, not a field)."""
    url, _ = served
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": "ab',
                   headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] is None
    assert "not valid JSON" in error["message"] and "character 28" in error["message"]


def test_a_streamed_chat_answer_ends_with_its_stop_reason(served):
    url, _ = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 30, "temperature": 0, "stream": True, "stop": ["\n"]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert "stop_reason" in last and last["finish_reason"] in ("stop", "length")
    if last["finish_reason"] == "stop":
        assert last["stop_reason"] in ("\n", None)
