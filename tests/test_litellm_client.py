"""LiteLLM, the library that puts one `completion()` in front of a hundred providers, as a
real client of chapter 9's server (issue 53): its `openai/` provider with `api_base`
pointing at the server, plain and streamed, and its tool calls (`tools`, `tool_choice`
"required" or a named function, streamed and put back together by
`litellm.stream_chunk_builder`), answered in OpenAI's shape.

Offline: LiteLLM fetches its model cost map from GitHub when imported unless
LITELLM_LOCAL_MODEL_COST_MAP=True, and counts tokens with tiktoken files it carries (it
points TIKTOKEN_CACHE_DIR at them itself); a fixture refuses any other host name."""
from __future__ import annotations

import json
import os

import pytest

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before litellm is imported
litellm = pytest.importorskip("litellm")
pytest.importorskip("fastapi")

from minillm.sampling import SamplingParams  # noqa: E402
from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from helpers import refuse_other_hosts  # noqa: E402
from test_serve import NAME, tiny_llm  # noqa: E402

litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" banner on errors
# its stream handling reads pydantic's model_fields off instances (deprecated in 2.11)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm")
MESSAGES = [{"role": "user", "content": "What news?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 12}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm(max_num_seqs=4)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm
    assert not llm.engine.requests and not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def offline():
    """The offline engine the answers are compared with: not the served one, whose
    engine thread would step a request added from here too (two threads, one engine)."""
    return tiny_llm(max_num_seqs=8)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    refuse_other_hosts(monkeypatch)


def complete(url: str, **kw):
    kw = {"max_tokens": 8, **kw}
    return litellm.completion(model=f"openai/{NAME}", api_base=url + "/v1", api_key="x",
                              messages=MESSAGES, temperature=0, max_retries=0, timeout=60,
                              **kw)


def test_completion_and_its_stream_give_the_greedy_answer(served, offline):
    url, llm = served[0], offline  # the same weights, its own engine
    reply = complete(url)
    assert isinstance(reply, litellm.ModelResponse)
    text = reply.choices[0].message.content
    assert isinstance(text, str) and text
    want = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert text == want[0].outputs[0].text
    usage = reply.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = list(complete(url, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    built = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    assert built.choices[0].message.content == text
    assert (built.usage.prompt_tokens, built.usage.completion_tokens) == \
        (usage.prompt_tokens, usage.completion_tokens)


def assert_weather_call(message) -> dict:
    """The message calls get_weather with a JSON object that has a string "city"."""
    call = message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    return arguments


def test_tool_choice_required_calls_the_tool(served):
    url, _ = served
    reply = complete(url, tools=[WEATHER], tool_choice="required", max_tokens=160,
                     parallel_tool_calls=False)
    assert_weather_call(reply.choices[0].message)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_a_named_tool_choice_calls_that_tool(served):
    """OpenAI's own API ends a named call with "stop" (vLLM too); "tool_calls" is the
    reason for "required" and "auto"."""
    url, _ = served
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = complete(url, tools=[WEATHER], tool_choice=named, max_tokens=160,
                     parallel_tool_calls=False)
    assert_weather_call(reply.choices[0].message)
    assert reply.choices[0].finish_reason in ("tool_calls", "stop")


def test_a_streamed_tool_call_builds_back_into_the_same_call(served):
    url, _ = served
    whole = complete(url, tools=[WEATHER], tool_choice="required", max_tokens=160,
                     parallel_tool_calls=False)
    chunks = list(complete(url, tools=[WEATHER], tool_choice="required", max_tokens=160,
                           parallel_tool_calls=False, stream=True))
    built = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    arguments = assert_weather_call(built.choices[0].message)
    assert arguments == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert len(built.choices[0].message.tool_calls) == \
        len(whole.choices[0].message.tool_calls)
    assert built.choices[0].finish_reason == "tool_calls"
