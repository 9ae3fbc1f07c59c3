"""OpenAI's Responses API, POST /v1/responses (issue 71, chapter 11's last section).

Checked with the real `openai` client (responses.create, responses.stream, retrieve, delete)
and LangChain's ChatOpenAI(use_responses_api=True): an answer equals the chat route's for the
same conversation; items (messages, function_call, function_call_output) become messages;
tools, tool_choice, text.format and max_output_tokens keep their promises; a stream's events
come in OpenAI's order and add up to the whole response; previous_response_id continues a
stored conversation; what the server cannot honour is a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from helpers import post, serving  # noqa: E402
from test_serve import NAME, tiny_llm  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
               "additionalProperties": False}}
CLOCK = {"type": "function", "name": "get_time", "description": "The time now",
         "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def served():
    with serving(tiny_llm(max_num_seqs=4), NAME) as both:
        yield both


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def create(client, **kw):
    kw = {"model": NAME, "input": ASK, "max_output_tokens": 12, "temperature": 0} | kw
    return client.responses.create(**kw)


def chat(client, messages, **kw):
    reply = client.chat.completions.create(model=NAME, messages=messages,
                                           temperature=0, **kw)
    return reply.choices[0], reply.usage


def test_a_text_answer_equals_the_chat_routes_and_says_why_it_stopped(client):
    r = create(client, instructions="Answer briefly.")
    same, usage = chat(client, [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": ASK}], max_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == same.message.content
    assert [x.type for x in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    cut = same.finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == (
        "max_output_tokens" if cut else None)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_items_become_the_messages_the_chat_route_would_get(client):
    items = [{"role": "system", "content": "Be short."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Hi. "},
                          {"type": "input_text", "text": ASK}]},
             {"role": "assistant", "content": [
                 {"type": "output_text", "text": "Sunny.", "annotations": []}]},
             {"role": "user", "content": "And tomorrow?"}]
    r = create(client, input=items)
    same, _ = chat(client, [{"role": "system", "content": "Be short."},
                            {"role": "user", "content": "Hi. " + ASK},
                            {"role": "assistant", "content": "Sunny."},
                            {"role": "user", "content": "And tomorrow?"}],
                   max_tokens=12)
    assert r.output_text == same.message.content


def test_a_named_function_is_exactly_one_call_with_valid_arguments(client):
    r = create(client, tools=[WEATHER, CLOCK], max_output_tokens=160,
               tool_choice={"type": "function", "name": "get_weather"})
    assert [x.type for x in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.status == "completed" and r.tools[0].name == "get_weather"


def test_a_call_cut_by_max_output_tokens_is_incomplete(client):
    r = create(client, tools=[WEATHER], tool_choice="required", max_output_tokens=60,
               parallel_tool_calls=False)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].type == "function_call" and r.output[-1].status == "incomplete"


def test_a_tool_loop_with_previous_response_id_equals_sending_everything(client):
    first = create(client, tools=[WEATHER], tool_choice="required",
                   max_output_tokens=160, parallel_tool_calls=False)
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "18 C, light rain"}
    kept = create(client, previous_response_id=first.id, input=[result],
                  tools=[WEATHER], max_output_tokens=20)
    whole = create(client, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments}, result], tools=[WEATHER], max_output_tokens=20)
    assert kept.output_text == whole.output_text and kept.output_text
    assert kept.previous_response_id == first.id
    assert kept.usage.input_tokens == whole.usage.input_tokens


def test_a_stored_response_is_read_back_and_deleted(client):
    r = create(client)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match=r.id):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|no stored"):
        create(client, previous_response_id=r.id)
    unkept = create(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


@pytest.mark.parametrize("tools", [None, "required"])
def test_a_stream_is_openais_events_in_order_adding_up_to_the_response(client, tools):
    kw = {} if tools is None else {"tools": [WEATHER, CLOCK], "tool_choice": tools,
                                   "max_output_tokens": 160}
    with client.responses.stream(model=NAME, input=ASK, temperature=0,
                                 **({"max_output_tokens": 12} | kw)) as stream:
        events = list(stream)
    final = events[-1].response  # completed, or incomplete (OpenAI's last event)
    plain = create(client, **kw)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert final.status == plain.status and final.usage == plain.usage
    assert [x.type for x in final.output] == [x.type for x in plain.output]
    for got, want in zip(final.output, plain.output):
        if want.type == "message":
            assert got.content[0].text == want.content[0].text
        else:
            assert (got.name, got.arguments) == (want.name, want.arguments)
    # each item: added, filled by deltas that add up, done
    for i, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == i]
        assert mine[0].type == "response.output_item.added"
        assert mine[-1].type == "response.output_item.done"
        delta = ("response.output_text.delta" if item.type == "message"
                 else "response.function_call_arguments.delta")
        pieces = "".join(e.delta for e in mine if e.type == delta)
        assert pieces == (item.content[0].text if item.type == "message"
                          else item.arguments)


def test_text_format_holds_the_answer_to_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string",
                                                        "maxLength": 10}},
              "required": ["city"], "additionalProperties": False}
    r = create(client, max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_logprobs_come_with_include(client):
    r = create(client, include=["message.output_text.logprobs"], top_logprobs=2)
    lp = r.output[0].content[0].logprobs
    assert len(lp) == r.usage.output_tokens
    assert all(len(x.top_logprobs) == 2 for x in lp)


@pytest.mark.parametrize("body, param, match", [
    ({"frequency": 1}, "frequency", "frequency"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"background": True}, "background", "not supported"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"include": ["file_search_call.results"]}, "include", "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs", "include"),
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning"),
    ({"input": [{"role": "user", "content": "hi", "colour": 1}]}, "input", "colour"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "x"}]}]}, "input", "text"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input", "role"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", "yaml"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER]},
     "text.format", "text.format"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
])
def test_what_the_server_cannot_honour_is_refused_by_name(served, body, param, match):
    reply = post(served[0], "/v1/responses",
                 {"model": NAME, "input": ASK, "max_output_tokens": 4} | body)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param and match in error["message"], error


def test_langchains_responses_client_answers_and_calls_tools(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        base_url=served[0] + "/v1", api_key="none", model=NAME, temperature=0,
        max_tokens=160, use_responses_api=True, max_retries=0)
    said = model.invoke("Say hello.")
    assert said.text and said.response_metadata.get("id", "").startswith("resp_")
    called = model.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK)
    (call,) = called.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["parameters"])
