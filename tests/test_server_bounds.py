"""Chapter 9's server against a hostile client (issue 38): every request's work is
bounded before it starts, a bad request is a 4xx naming what is wrong and what is
allowed, the JSON is always JSON, and the server goes on serving the others with
nothing left in its engine. Raw HTTP (httpx) where the `openai` client would refuse to
send what a hostile client sends."""
from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers import post
from test_serve import NAME, metrics, tiny_llm, wait_idle

from minillm.serve.app import build_app
from minillm.serve.cli import BackgroundServer

HELLO = {"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 4, "temperature": 0}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}






def refused(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    """The answer is OpenAI's error with `status`, naming `param` and `words`."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def still_serving(url: str, engine) -> None:
    """Nothing is left in the engine, and the next request gets its answer."""
    wait_idle(url)
    assert not engine.requests
    r = post(url, "/v1/completions", HELLO)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_idle(url)
    assert not engine.requests


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every JSON parser but Python's."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


# --- 1. n -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [129, 10**12])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_above_openais_128_is_400_before_any_work(served, path, n):
    url, engine = served
    body = {**(HELLO if "chat" not in path else CHAT), "n": n}
    refused(post(url, path, body), 400, "n", str(n), "128")
    still_serving(url, engine)


def test_max_waiting_counts_answers_not_requests():
    llm = tiny_llm(max_num_seqs=1)
    with BackgroundServer(build_app(llm, NAME, max_waiting=2)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        long = {"model": NAME, "max_tokens": 450, "temperature": 0, "stream": True,
                "extra_body": {"ignore_eos": True}}
        running = client.completions.create(prompt="A:\n", **long)
        next(iter(running))  # A runs: the one row is taken
        with pytest.raises(openai.BadRequestError) as e:  # can never wait
            client.completions.create(prompt="B:\n", n=3, **long)
        assert e.value.param == "n" and "max_waiting=2" in e.value.message
        waiting = client.completions.create(prompt="C:\n", **long)  # one waits
        assert metrics(server.url)["minillm:num_requests_waiting"] == 1
        with pytest.raises(openai.RateLimitError) as e:  # 1 + 2 answers > 2
            client.completions.create(prompt="D:\n", n=2, **long)
        assert e.value.code == "queue_full"
        assert metrics(server.url)["minillm:num_requests_waiting"] == 1
        running.close()
        waiting.close()
        wait_idle(server.url)
    assert not llm.engine.requests


def test_max_waiting_counts_the_answers_held_for_their_prompt():
    """n > 1 on paged KV: answers 1..n-1 wait until answer 0 computed the prompt; they
    count against max_waiting and in the waiting metric (issue 52)."""
    llm = tiny_llm(max_num_seqs=1)
    with BackgroundServer(build_app(llm, NAME, max_waiting=3)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        long = {"model": NAME, "max_tokens": 450, "temperature": 0, "stream": True,
                "extra_body": {"ignore_eos": True}}
        running = client.completions.create(prompt="A:\n", **long)
        next(iter(running))  # A runs: the one row is taken
        waiting = client.completions.create(prompt="C:\n", n=2, **long)
        assert metrics(server.url)["minillm:num_requests_waiting"] == 2
        with pytest.raises(openai.RateLimitError):  # 2 + 2 answers > 3
            client.completions.create(prompt="D:\n", n=2, **long)
        running.close()
        waiting.close()
        wait_idle(server.url)
    assert not llm.engine.requests


# --- 2. logprobs are finite JSON ------------------------------------------------------

def blocked_logprobs_body(vocab: int) -> dict:
    """min_tokens with every id but 0 a stop id: the k best of the first tokens
    include blocked ones, whose log-probability is -inf."""
    return {**HELLO, "max_tokens": 3, "min_tokens": 2, "logprobs": 3,
            "stop_token_ids": list(range(1, vocab))}


def test_logprobs_of_blocked_tokens_are_finite_json(served):
    url, engine = served
    body = blocked_logprobs_body(engine.tokenizer.vocab_size)
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    lp = strict_json(r.text)["choices"][0]["logprobs"]
    values = [v for top in lp["top_logprobs"] for v in top.values()]
    assert min(values) == -9999.0 and min(lp["token_logprobs"]) > -9999.0  # as vLLM
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [strict_json(e)["choices"][0]["logprobs"] for e in events]
    assert min(v for lp in streamed for top in lp["top_logprobs"]
               for v in top.values()) == -9999.0
    chat = {**CHAT, "max_tokens": 3, "min_tokens": 2, "logprobs": True,
            "top_logprobs": 3, "stop_token_ids": body["stop_token_ids"]}
    r = post(url, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert min(t["logprob"] for c in content for t in c["top_logprobs"]) == -9999.0
    still_serving(url, engine)


# --- 3. text that is not text ---------------------------------------------------------

def test_a_lone_surrogate_in_a_prompt_is_400(served):
    url, engine = served
    raw = b'{"model": "%s", "prompt": "\\ud800 ROMEO", "max_tokens": 4}' % NAME.encode()
    refused(post(url, "/v1/completions", raw), 400, "prompt", "surrogate")
    raw = (b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}'
           % NAME.encode())
    assert post(url, "/v1/chat/completions", raw).status_code == 400
    still_serving(url, engine)


# --- 4. the body's size, the prompt's length, tokenizing off the event loop -----------

def test_a_body_over_max_body_bytes_is_413_before_it_is_read():
    llm = tiny_llm(max_num_seqs=2)
    with BackgroundServer(build_app(llm, NAME, max_body_bytes=10_000)) as server:
        big = {**HELLO, "prompt": "x" * 20_000}
        error = refused(post(server.url, "/v1/completions", big), 413, None,
                        "max_body_bytes=10000")
        assert error["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(20):
                yield b" " * 1000
            yield json.dumps(HELLO).encode()
        r = httpx.post(server.url + "/v1/completions", content=chunks(),
                       headers={"Content-Type": "application/json"}, timeout=60)
        refused(r, 413, None, "max_body_bytes=10000")
        still_serving(server.url, llm.engine)
    with pytest.raises(ValueError, match="max_body_bytes"):
        build_app(llm, NAME, max_body_bytes=0)


def test_a_text_prompt_far_over_the_context_is_400_without_tokenizing(served):
    url, engine = served
    encode, calls = engine.tokenizer.encode, []

    def recording(text, *a, **kw):
        calls.append((len(text), threading.current_thread().name))
        return encode(text, *a, **kw)

    engine.tokenizer.encode = recording
    try:
        huge = {**HELLO, "prompt": "To be, or not to be. " * 100_000}  # 2.1 MB
        refused(post(url, "/v1/completions", huge), 400, "prompt",
                f"max_model_len={engine.max_model_len}")
        assert all(n < 100_000 for n, _ in calls)  # never tokenized
        calls.clear()
        assert post(url, "/v1/completions", HELLO).status_code == 200
        assert calls and all(name != "minillm-http" for _, name in calls)  # a worker
    finally:
        engine.tokenizer.encode = encode
    ids = {**HELLO, "prompt": [7] * (engine.max_model_len + 1)}
    refused(post(url, "/v1/completions", ids), 400, "prompt",
            f"max_model_len={engine.max_model_len}")
    still_serving(url, engine)


# --- 5. stop lists --------------------------------------------------------------------

@pytest.mark.parametrize("stop, words", [
    ([f"zz{i}" for i in range(65)], ["65", "64"]),
    ("q" * 257, ["256"]),
])
def test_stop_lists_are_bounded(served, stop, words):
    url, engine = served
    refused(post(url, "/v1/completions", {**HELLO, "stop": stop}), 400, "stop", *words)
    refused(post(url, "/v1/chat/completions", {**CHAT, "stop": stop}), 400, "stop")
    most = [f"zz{i}" for i in range(64)]
    ok = post(url, "/v1/completions", {**HELLO, "stop": most})
    assert ok.status_code == 200
    still_serving(url, engine)


# --- 6. a client that gives up --------------------------------------------------------

class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_that_gives_up_leaves_no_traceback(served):
    url, engine = served
    errors = Errors()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "asyncio")]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        before = metrics(url).get("minillm:request_success_total[abort]", 0)
        long = {"max_tokens": 400, "ignore_eos": True}
        for path, body in [("/v1/completions", {**HELLO, **long}),
                           ("/v1/chat/completions", {**CHAT, **long})]:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + path, json=body, timeout=httpx.Timeout(60, read=0.3))
        m = wait_idle(url)
        assert m["minillm:request_success_total[abort]"] == before + 2
    finally:
        for logger in loggers:
            logger.removeHandler(errors)
    assert not errors.records, [r.getMessage() for r in errors.records]
    still_serving(url, engine)


# --- 7. what is not supported is refused, OpenAI's ranges -----------------------------

UNSUPPORTED = [  # (endpoint, fields, the param the 400 names)
    ("completions", {"logit_bias": {"50": 101}}, "logit_bias"),  # OpenAI's [-100, 100]
    ("completions", {"best_of": 3}, "best_of"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format"),  # ch. 11
    # does json_object and json_schema (tests/test_structured_server.py)
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),  # chat has tools (chapter 11, tests/test_tool_calls.py)
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # without tools
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
    ("completions", {"temperature": 2.5}, "temperature"),
    ("chat", {"temperature": 100}, "temperature"),
]


@pytest.mark.parametrize("endpoint, fields, param", UNSUPPORTED,
                         ids=[f"{e}-{p}" for e, _, p in UNSUPPORTED])
def test_what_is_not_supported_is_400_naming_it(served, endpoint, fields, param):
    url, engine = served
    path, body = (("/v1/completions", HELLO) if endpoint == "completions"
                  else ("/v1/chat/completions", CHAT))
    refused(post(url, path, {**body, **fields}), 400, param, param)
    wait_idle(url)
    assert not engine.requests


def test_the_harmless_values_of_those_fields_are_accepted(served):
    url, engine = served
    r = post(url, "/v1/completions", {**HELLO, "logit_bias": {}, "best_of": 1,
                                      "temperature": 2})
    assert r.status_code == 200, r.text
    r = post(url, "/v1/chat/completions", {
        **CHAT, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
        "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    still_serving(url, engine)


# --- 8. a stuck engine thread ---------------------------------------------------------

def test_health_is_503_while_the_engine_thread_is_stuck_in_a_step():
    llm = tiny_llm(max_num_seqs=2)
    step, release = llm.engine.step, threading.Event()

    def stuck():  # a step that does not end until the test says so
        release.wait(60)
        return step()

    with BackgroundServer(build_app(llm, NAME)) as server:
        engine = server.app.state.server.engine
        assert httpx.get(server.url + "/health").status_code == 200  # idle, asleep
        engine.stall_after = 0.05
        llm.engine.step = stuck
        answer = []
        caller = threading.Thread(target=lambda: answer.append(
            post(server.url, "/v1/completions", HELLO)))
        caller.start()
        try:
            for _ in range(500):
                if httpx.get(server.url + "/health").status_code == 503:
                    break
                threading.Event().wait(0.02)
            else:
                raise AssertionError("/health never noticed the stuck step")
            assert engine.alive  # alive, and yet serving nobody
        finally:
            llm.engine.step = step
            release.set()
            caller.join(60)
        assert answer[0].status_code == 200
        wait_idle(server.url)
        assert httpx.get(server.url + "/health").status_code == 200
    assert not llm.engine.requests
