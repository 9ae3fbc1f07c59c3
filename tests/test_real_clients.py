"""The programs people point at an OpenAI server, run for real against chapter 9's server
(issue 53): lm-evaluation-harness's `local-completions` (a multiple-choice task and a
generate_until task, local jsonl files, --batch_size 4, its default tokenizer: the server's
/tokenizer_info, /tokenize and /detokenize), and LangChain's ChatOpenAI (invoke, stream,
with_structured_output both ways, bind_tools and a tool-result turn). lm-eval's
log-likelihoods must be the offline engine's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from minillm.sampling import SamplingParams  # noqa: E402
from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from test_serve import NAME, tiny_llm  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = {
    "tinymc": """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "tinygen": """output_type: generate_until
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm(max_num_seqs=8)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm
    assert not llm.engine.requests


@pytest.fixture(scope="module")
def offline():
    """The offline engine the answers are compared with: not the served one, whose
    engine thread would step a request added from here too (two threads, one engine)."""
    return tiny_llm(max_num_seqs=8)


def write_tasks(folder: Path) -> None:
    files = {"tinymc": DATA / "mc.jsonl", "tinygen": DATA / "gen.jsonl"}
    for name, rest in TASKS.items():
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {files[name]}\ntest_split: test\n"
            'doc_to_text: "{{context}}"\n' + rest, encoding="utf-8")


def test_lm_eval_scores_against_the_server_as_the_offline_engine(served, offline,
                                                                 tmp_path):
    url, llm = served[0], offline  # the same weights, its own engine
    write_tasks(tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TQDM_DISABLE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions",
         "--model_args", f"model={NAME},base_url={url}/v1/completions,"
         "num_concurrent=1,max_retries=1", "--tasks", "tinymc,tinygen",
         "--include_path", str(tmp_path), "--batch_size", "4", "--log_samples",
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    tok = llm.get_tokenizer()
    scored = 0
    mc = next((tmp_path / "out").rglob("samples_tinymc_*.jsonl"))
    for line in mc.read_text().splitlines():
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context = tok.encode(args["arg_0"], False)
            whole = context + tok.encode(args["arg_1"], False)
            out = llm.generate([{"prompt_token_ids": whole}], SamplingParams(
                temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
            want = sum(top[t].logprob for t, top in zip(
                whole[len(context):], out.prompt_logprobs[len(context):]))
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4)
            scored += 1
    assert scored == 12
    gen = next((tmp_path / "out").rglob("samples_tinygen_*.jsonl"))
    for line in gen.read_text().splitlines():
        sample = json.loads(line)
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        want = llm.generate([{"prompt_token_ids": tok.encode(prompt, False)}],
                            SamplingParams(temperature=0, max_tokens=16, stop=["\n"]),
                            use_tqdm=False)[0].outputs[0].text
        assert sample["resps"][0][0] == want


def test_lm_eval_local_chat_completions_generates_as_llm_chat(served, offline,
                                                              tmp_path):
    """lm-eval's chat model (`local-chat-completions`, batch 1, with the chat template
    applied by the server) on the generate_until task: each answer is LLM.chat's."""
    url, llm = served[0], offline  # the same weights, its own engine
    write_tasks(tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TQDM_DISABLE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-chat-completions",
         "--model_args", f"model={NAME},base_url={url}/v1/chat/completions,"
         "num_concurrent=1,max_retries=1", "--tasks", "tinygen", "--include_path",
         str(tmp_path), "--apply_chat_template", "--log_samples", "--output_path",
         str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    gen = next((tmp_path / "out").rglob("samples_tinygen_*.jsonl"))
    answers = 0
    for line in gen.read_text().splitlines():
        sample = json.loads(line)
        messages = json.loads(sample["arguments"]["gen_args_0"]["arg_0"][0])
        want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16,
                                                 stop=["\n"]), use_tqdm=False)
        assert sample["resps"][0][0] == want[0].outputs[0].text
        answers += 1
    assert answers == 4


def test_langchain_chat_openai_invokes_streams_and_structures(served, offline):
    langchain_openai = pytest.importorskip("langchain_openai")
    url, llm = served[0], offline  # the same weights, its own engine
    chat = langchain_openai.ChatOpenAI(model=NAME, base_url=url + "/v1", api_key="none",
                                       temperature=0, max_tokens=12, max_retries=0)
    answer = chat.invoke("What news?")
    want = llm.chat([{"role": "user", "content": "What news?"}],
                    SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert answer.content == want[0].outputs[0].text
    assert "".join(c.content for c in chat.stream("What news?")) == answer.content
    schema = {"title": "Line", "type": "object",
              "properties": {"speaker": {"type": "string", "maxLength": 12}},
              "required": ["speaker"], "additionalProperties": False}
    longer = langchain_openai.ChatOpenAI(model=NAME, base_url=url + "/v1",
                                         api_key="none", temperature=0, max_tokens=60,
                                         max_retries=0)
    result = longer.with_structured_output(schema).invoke("Who speaks?")
    assert set(result) == {"speaker"} and isinstance(result["speaker"], str)


def test_langchain_tool_calls_bind_tools_and_a_tool_result_turn(served):
    """LangChain's tool paths, as an agent uses them: with_structured_output(method=
    "function_calling") (a named tool_choice, parallel_tool_calls false), bind_tools
    with tool_choice "any" (sent as "required") and a named tool, then the tool's
    result sent back (an AIMessage with tool_calls, a ToolMessage) and answered."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    url, _ = served
    chat = langchain_openai.ChatOpenAI(model=NAME, base_url=url + "/v1", api_key="none",
                                       temperature=0, max_tokens=160, max_retries=0)
    schema = {"title": "Line", "description": "Who speaks the line.", "type": "object",
              "properties": {"speaker": {"type": "string", "maxLength": 12}},
              "required": ["speaker"]}
    line = chat.with_structured_output(schema, method="function_calling").invoke("Who?")
    assert set(line) == {"speaker"} and isinstance(line["speaker"], str)

    @tool
    def weather(city: Literal["Ayr", "Rome"]) -> str:  # the tiny model rambles
        """The weather of a city now."""
        return f"Rain in {city}."

    @tool
    def clock() -> str:
        """The time now."""
        return "noon"
    for choice, names in (("any", {"weather", "clock"}), ("clock", {"clock"})):
        asked = chat.bind_tools([weather, clock], tool_choice=choice,
                                parallel_tool_calls=False).invoke("Rain?")
        assert len(asked.tool_calls) == 1 and asked.tool_calls[0]["name"] in names
    call = asked.tool_calls[0]
    assert call["args"] == {} and call["id"].startswith("call_")
    history = [HumanMessage("What time is it?"), asked,
               ToolMessage(clock.invoke(call["args"]), tool_call_id=call["id"])]
    answer = chat.bind_tools([weather, clock]).invoke(history)
    assert isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_the_openai_clients_parse_returns_a_pydantic_object(served):
    """openai's `chat.completions.parse(response_format=Model)`: a strict json_schema
    made from a pydantic model, answered under chapter 11's grammar and parsed back."""
    import openai
    from typing import Literal

    from pydantic import BaseModel
    url, _ = served

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        sure: bool

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.parse(
        model=NAME, messages=[{"role": "user", "content": "Is it so?"}],
        response_format=Verdict, max_tokens=40, temperature=0)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.answer in ("yes", "no")
