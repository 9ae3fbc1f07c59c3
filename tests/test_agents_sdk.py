"""The OpenAI Agents SDK (`openai-agents`) as a real client of POST /v1/responses (issue 71):
its `Runner` drives an `Agent` whose model is the SDK's `OpenAIResponsesModel` on an
`AsyncOpenAI` client pointed at the server. A plain run's final output is the chat route's
answer to the same conversation; a function tool forced by `tool_choice` is really called,
with arguments held to the schema the SDK wrote, and with `stop_on_first_tool` its return
value is the final output; a streamed run's text deltas add up to its final output.

The model is an `OpenAIResponsesModel` given its own client, not a model name: the SDK reads
a "/" in a name as a provider prefix, and a name alone would need a process-wide default
client. Tracing is off (it would post spans to api.openai.com), and a fixture refuses any
host name but this machine's. The SDK raises on a response that is `incomplete`, so every
answer here must end before `max_tokens`, as the tiny model's answer to "Say hello." does."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated

import pytest

openai = pytest.importorskip("openai")
agents = pytest.importorskip("agents")
pytest.importorskip("fastapi")
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner,  # noqa: E402
                    function_tool, set_tracing_disabled)
from agents.items import ToolCallItem, ToolCallOutputItem  # noqa: E402
from pydantic import Field  # noqa: E402

from helpers import refuse_other_hosts, serving  # noqa: E402
from test_serve import NAME, tiny_llm  # noqa: E402

set_tracing_disabled(True)
INSTRUCTIONS, ASK = "Answer briefly.", "Say hello."
GREEDY = ModelSettings(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def served():
    with serving(tiny_llm(max_num_seqs=4), NAME) as both:
        yield both


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    refuse_other_hosts(monkeypatch)


@contextlib.asynccontextmanager
async def responses_model(url: str):
    """The SDK's Responses model of the server, on a client closed afterwards."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                  timeout=60) as client:
        yield OpenAIResponsesModel(model=NAME, openai_client=client)


def plain_agent(model) -> Agent:
    return Agent(name="plain", instructions=INSTRUCTIONS, model=model, model_settings=GREEDY)


def chat_answer(url: str) -> str:
    """The chat route's greedy answer to the same conversation; it must have stopped by
    itself (the SDK refuses an incomplete response)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=GREEDY.max_tokens,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": ASK}]).choices[0]
    assert reply.finish_reason == "stop", reply
    return reply.message.content


def test_a_run_answers_what_the_chat_route_answers(served):
    async def main():
        async with responses_model(served[0]) as model:
            return await Runner.run(plain_agent(model), ASK)

    result = asyncio.run(main())
    want = chat_answer(served[0])
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.final_output == want
    (response,) = result.raw_responses  # one model call, no tool turn
    assert response.response_id.startswith("resp_")


def test_a_forced_function_tool_is_called_and_its_value_is_the_answer(served):
    called, returned = [], []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city now."""
        called.append(city)
        returned.append(f"18 C, light rain in {city}")
        return returned[-1]

    async def main():
        async with responses_model(served[0]) as model:
            agent = Agent(name="weather", instructions="Use the tools.", model=model,
                          tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                          model_settings=ModelSettings(temperature=0, max_tokens=160,
                                                       tool_choice="get_weather"))
            return await Runner.run(agent, "What's the weather in Paris?")

    result = asyncio.run(main())
    assert len(called) == 1 and len(called[0]) <= 12  # the schema's maxLength held
    assert result.final_output == returned[0]
    call, output = result.new_items
    assert isinstance(call, ToolCallItem) and isinstance(output, ToolCallOutputItem)
    assert call.raw_item.name == "get_weather"
    assert json.loads(call.raw_item.arguments) == {"city": called[0]}
    assert output.output == returned[0]
    assert len(result.raw_responses) == 1  # stop_on_first_tool: no second model call


def test_a_streamed_runs_text_deltas_add_up_to_its_final_output(served):
    async def main():
        async with responses_model(served[0]) as model:
            run = Runner.run_streamed(plain_agent(model), ASK)
            events = [e async for e in run.stream_events()]
            return run, events

    run, events = asyncio.run(main())
    raw = [e.data for e in events if e.type == "raw_response_event"]
    deltas = [e.delta for e in raw if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and run.is_complete
    assert "".join(deltas) == run.final_output
    assert run.final_output == chat_answer(served[0])  # the same greedy answer
    assert raw[0].type == "response.created" and raw[-1].type == "response.completed"
