"""Chapter 9's OpenAI-compatible server, called with the real `openai` client over HTTP
on 127.0.0.1: every answer at temperature 0 must equal the offline answer of LLM.generate
or LLM.chat, bad requests get OpenAI's error format before any work, and every server a
test starts is stopped with nothing left in its engine."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minillm.engine.llm import LLM  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402
from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from minillm.utils import bundled_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "tiny"
PLAY = (  # the plays' format; tools, calls and results (chapter 11) written briefly
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
    "\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}RESULT:\n"
    "{{ m.content }}\n\n{% elif m.tool_calls %}ROSS:\n{% for c in m.tool_calls %}"
    "<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}\n\n{% else %}"
    "MACDUFF:\n{{ m['content'] }}\n\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ROSS:\n{% endif %}")
PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo", "KING HENRY:\n", "HAMLET:\nTo be",
           "MACBETH:\n", "LADY MACBETH:\nOut", "OTHELLO:\n", "IAGO:\nI am",
           "KING LEAR:\n", "CORDELIA:\nNothing", "PROSPERO:\n", "ARIEL:\nAll hail",
           "BRUTUS:\n", "CASSIUS:\nThe fault", "PORTIA:\n", "PUCK:\nIf we"]


def tiny_llm(**kw) -> LLM:
    llm = LLM(bundled_model_path(), **kw)
    llm.engine.tokenizer.chat_template = PLAY
    return llm


def greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def offline():
    """The offline engine: what the server must reproduce, token for token."""
    return tiny_llm(max_num_seqs=16)


@pytest.fixture(scope="module")
def served():
    """One server for the module; the engine is checked empty after it stopped."""
    llm = tiny_llm(max_num_seqs=16)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server, llm.engine
    assert not server.thread.is_alive()
    assert not llm.engine.requests and not llm.engine.has_unfinished()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0)


def metrics(url: str) -> dict:
    """The scraped samples, {name: value} (labels other than model_name joined in)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "le")}
            key = s.name + "".join(f"[{v}]" for v in extra.values())
            if "le" not in s.labels:
                out[key] = s.value
    return out


def wait_idle(url: str) -> dict:
    """Poll /metrics until nothing runs or waits and the KV memory is free."""
    for _ in range(500):
        m = metrics(url)
        if (m["minillm:num_requests_running"] == m["minillm:num_requests_waiting"]
                == m["minillm:kv_cache_usage_perc"] == 0):
            return m
        time.sleep(0.02)
    raise AssertionError(f"the server did not become idle: {m}")


# --- answers -----------------------------------------------------------------------

def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]


def test_completion_equals_offline_greedy(client, offline):
    want = offline.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24,
                                    temperature=0)
    assert got.object == "text_completion" and got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_token_id_prompt_is_accepted(client, offline):
    ids = offline.engine.tokenizer.encode(PROMPTS[1])
    want = offline.generate(ids, greedy(), use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0)
    assert got.choices[0].text == want


def test_streamed_completion_equals_offline_and_reports_usage(client, offline):
    want = offline.generate(PROMPTS[2], greedy(), use_tqdm=False)[0].outputs[0]
    chunks = list(client.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    body, last = [c for c in chunks if c.choices], chunks[-1]
    assert len(body) > 1  # it really came in pieces
    assert "".join(c.choices[0].text for c in body) == want.text
    assert body[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert last.choices == [] and last.usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in body)


def test_chat_and_streamed_chat_equal_llm_chat(client, offline):
    messages = [{"role": "user", "content": "Who is there?"}]
    want = offline.chat(messages, greedy(20), use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20,
                                         temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=20, temperature=0,
        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_the_rest_of_the_context(client, served):
    got = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Speak."}], temperature=0,
        extra_body={"ignore_eos": True})
    assert got.usage.total_tokens == served[1].max_model_len
    assert got.choices[0].finish_reason == "length"


def test_n2_gives_two_answers_of_their_own(client, offline):
    got = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=16,
                                    temperature=1.0, seed=3, n=2)
    assert sorted(c.index for c in got.choices) == [0, 1]
    assert got.choices[0].text != got.choices[1].text  # two draws, not one twice
    want = offline.generate(PROMPTS[3], SamplingParams(temperature=1.0, seed=3, n=2,
                                                       max_tokens=16), use_tqdm=False)
    assert [c.text for c in got.choices] == [o.text for o in want[0].outputs]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want[0].outputs)
    streamed = ["", ""]
    for chunk in client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=16,
                                           temperature=1.0, seed=3, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in got.choices]


def test_stop_string_ends_the_answer_before_it(client, offline):
    full = offline.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0].text
    stop = full.split()[3]  # a word from the middle of the answer
    assert stop in full
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24,
                                    temperature=0, stop=[stop, "zzz"])
    c = got.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    assert c.text == full[:full.index(stop)] and stop not in c.text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
        stream=True))
    assert streamed == c.text  # the stop string is never streamed either
    kept = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24,
                                     temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == c.text + stop


def test_completion_logprobs(client):
    got = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=8,
                                    temperature=0, logprobs=2)
    c = got.choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == 8
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(top) <= 3 and top[token] == value == max(top.values())  # greedy
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_chat_logprobs(client):
    got = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Speak."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert "".join(t.token for t in content) == got.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode() == t.token


# --- errors ---------------------------------------------------------------------------

BAD = [  # (endpoint, fields, the param the 400 names)
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"top_k": -3}, "top_k"),
    ("completions", {"presence_penalty": 3.0}, "presence_penalty"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"max_tokens": 2.5}, "max_tokens"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": ["a"] * 129}, "prompt"),
    ("completions", {"prompt": ["a", "b"], "n": 65}, "prompt"),
    ("completions", {"echo": True, "max_tokens": 0, "stream": True}, "stream"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
]


@pytest.mark.parametrize("endpoint, fields, param", BAD,
                         ids=[f"{e}-{p}" for e, _, p in BAD])
def test_bad_parameters_are_400_naming_the_field(served, endpoint, fields, param):
    url, engine = served[0].url, served[1]
    body = ({"prompt": "ROMEO:\n"} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(url + path, json={"model": NAME, **body, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]
    assert wait_idle(url) and not engine.requests  # nothing was queued


def test_a_prompt_too_long_for_the_context_is_400(client, served):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=NAME, prompt=PROMPTS[0],
                                  max_tokens=served[1].max_model_len)


def test_the_openai_client_raises_on_bad_values(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, temperature=-1,
                                       messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and e.value.param == "temperature"


def test_unknown_model_and_path_are_404(client, served):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi")
    assert e.value.param == "model" and e.value.code == "model_not_found"
    r = httpx.get(served[0].url + "/v1/nothing-here")
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_health(served):
    assert httpx.get(served[0].url + "/health").status_code == 200


# --- many clients, dropped clients, limits -------------------------------------------

def test_16_concurrent_streams_each_get_their_offline_answer(served, offline):
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy(),
                                                          use_tqdm=False)]

    async def one(client, prompt):
        text = ""
        async for chunk in await client.completions.create(
                model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True):
            text += chunk.choices[0].text
        return text

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=served[0].url + "/v1", api_key="none",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    before = metrics(served[0].url)
    assert asyncio.run(all_at_once()) == want
    after = wait_idle(served[0].url)
    assert (after["minillm:time_to_first_token_seconds_count"]
            - before["minillm:time_to_first_token_seconds_count"]) == 16
    assert (after["minillm:generation_tokens_total"]
            - before["minillm:generation_tokens_total"]) == sum(
                len(o.outputs[0].token_ids) for o in offline.generate(
                    PROMPTS, greedy(), use_tqdm=False))


def test_a_dropped_stream_is_aborted_and_its_memory_freed(served):
    url, engine = served[0].url, served[1]
    before = metrics(url).get("minillm:request_success_total[abort]", 0)
    body = {"model": NAME, "prompt": PROMPTS[5], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        assert metrics(url)["minillm:num_requests_running"] == 1
        assert metrics(url)["minillm:kv_cache_usage_perc"] > 0
    # the connection is closed: the request ends long before its 400 tokens
    after = wait_idle(url)
    assert after["minillm:request_success_total[abort]"] == before + 1
    assert not engine.requests  # aborted and forgotten


def test_a_full_queue_answers_429():
    llm = tiny_llm(max_num_seqs=1)
    with BackgroundServer(build_app(llm, NAME, max_waiting=1)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               max_retries=0)
        long = dict(model=NAME, max_tokens=450, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
        running = client.completions.create(prompt="A:\n", **long)
        next(iter(running))  # A has its first token: it runs
        waiting = client.completions.create(prompt="B:\n", **long)  # B queues
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(prompt="C:\n", **long)
        assert e.value.status_code == 429 and e.value.code == "queue_full"
        assert metrics(server.url)["minillm:num_requests_waiting"] == 1
        running.close()
        waiting.close()
        wait_idle(server.url)
    assert not llm.engine.requests


def test_a_request_past_its_timeout_is_aborted_with_a_clear_error():
    llm = tiny_llm(max_num_seqs=2)
    with BackgroundServer(build_app(llm, NAME, request_timeout=0.05)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               max_retries=0)
        long = dict(model=NAME, prompt="A:\n", max_tokens=500, temperature=0,
                    extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIStatusError, match="request_timeout") as e:
            client.completions.create(**long)
        assert e.value.status_code == 408 and e.value.code == "request_timeout"
        with pytest.raises(openai.APIError, match="request_timeout"):
            for _ in client.completions.create(stream=True, **long):
                pass
        m = wait_idle(server.url)
        assert m["minillm:request_success_total[timeout]"] == 2
    assert not llm.engine.requests


def test_shutdown_aborts_what_runs_and_stops_the_engine_thread():
    llm = tiny_llm(max_num_seqs=2)
    app = build_app(llm, NAME)
    server = BackgroundServer(app)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model=NAME, prompt="A:\n", max_tokens=480,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    engine_thread = app.state.server.engine._thread
    assert engine_thread.is_alive() and llm.engine.has_unfinished()
    server.stop()
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in stream:  # the open stream hears why it ended
            pass
    assert not engine_thread.is_alive() and not server.thread.is_alive()
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert llm.engine.kv.usage()[0] == 0


def test_two_servers_in_one_process_have_their_own_metrics(served):
    llm = tiny_llm(max_num_seqs=2)
    with BackgroundServer(build_app(llm, "other")) as other:
        assert metrics(other.url)["minillm:generation_tokens_total"] == 0
        assert metrics(served[0].url)["minillm:generation_tokens_total"] > 0


def test_chat_on_a_model_without_a_template_is_400():
    llm = LLM(bundled_model_path(), max_num_seqs=2)  # the tiny model has none
    with BackgroundServer(build_app(llm, NAME)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               max_retries=0)
        with pytest.raises(openai.BadRequestError, match="chat template") as e:
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "hi"}])
        assert e.value.param == "messages"


def test_a_failed_step_fails_its_requests_and_the_server_goes_on():
    llm = tiny_llm(max_num_seqs=2)
    step, calls = llm.engine.step, []

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a broken kernel")
        return step()

    llm.engine.step = broken_once
    with BackgroundServer(build_app(llm, NAME)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               max_retries=0)
        with pytest.raises(openai.InternalServerError, match="a broken kernel") as e:
            client.completions.create(model=NAME, prompt="A:\n", max_tokens=4)
        assert e.value.status_code == 503  # never a 500
        health = httpx.get(server.url + "/health")  # the truth, until a step succeeds
        assert health.status_code == 503 and "a broken kernel" in health.json()["reason"]
        ok = client.completions.create(model=NAME, prompt="A:\n", max_tokens=4)
        assert ok.usage.completion_tokens == 4
        assert httpx.get(server.url + "/health").status_code == 200
    assert not llm.engine.requests


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_fails_requests_and_health():
    llm = tiny_llm(max_num_seqs=2)
    with BackgroundServer(build_app(llm, NAME)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               max_retries=0)
        llm.engine.has_unfinished = lambda: 1 / 0  # the loop itself breaks
        with pytest.raises(openai.InternalServerError, match="ZeroDivisionError"):
            client.completions.create(model=NAME, prompt="A:\n", max_tokens=4)
        assert httpx.get(server.url + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as e:  # refused at once now
            client.completions.create(model=NAME, prompt="A:\n", max_tokens=4)
        assert e.value.status_code == 503


# --- the command line -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_minillm_serve(offline):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minillm", "serve", str(bundled_model_path()),
         "--port", str(port), "--served-model-name", NAME, "--max-num-seqs", "4",
         "--max-model-len", "256", "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].max_model_len == 256
        want = offline.generate(PROMPTS[6], greedy(), use_tqdm=False)[0].outputs[0].text
        got = client.completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=24,
                                        temperature=0)
        assert got.choices[0].text == want
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out


def test_command_line_usage():
    from minillm.__main__ import main
    assert main([]) == 2 and main(["--help"]) == 0 and main(["nope"]) == 2
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
