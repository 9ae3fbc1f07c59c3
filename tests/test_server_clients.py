"""Chapter 9's server as the programs people point at an OpenAI server call it (issue 53):
lm-evaluation-harness's log-likelihood request (a list of token-id prompts, echo, logprobs=1,
max_tokens=1), echo with max_tokens=0, several prompts in one request answered
prompt-major, and vLLM's /tokenizer_info. The bodies are the ones lm-eval 0.4 sends
(recorded through a logging proxy, ../shared/notes/clients.md)."""
from __future__ import annotations

import json
import math

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from minillm.sampling import SamplingParams  # noqa: E402
from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from test_serve import NAME, tiny_llm, wait_idle  # noqa: E402

CONTEXTS = ["ROMEO:\nBut soft", "JULIET:\nO Romeo", "HAMLET:\nTo be", "IAGO:\nI am"]
ENDINGS = [", what light", " Romeo", " or not", " not what"]


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm(max_num_seqs=8)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm
    assert not llm.engine.requests and not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def offline():
    return tiny_llm(max_num_seqs=8)


def offline_scores(llm, ids: list[int]) -> list[tuple[float, int]]:
    """Each prompt token's (log-prob, rank) after the ones before, from chapter 4's
    prompt_logprobs: what the server's echo must report."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return [(top[t].logprob, top[t].rank)
            for t, top in zip(ids[1:], out.prompt_logprobs[1:])]


def test_lm_evals_loglikelihood_request_scores_like_the_offline_engine(served, offline):
    """lm-eval's body for a multiple-choice batch (--batch_size 4): token-id prompts,
    echo, logprobs=1, max_tokens=1. It sums token_logprobs[ctxlen:-1] and calls the
    continuation greedy when each equals the max of its top_logprobs."""
    url, _ = served
    tok = offline.engine.tokenizer
    pairs = [(tok.encode(c), tok.encode(c + e)) for c, e in zip(CONTEXTS, ENDINGS)]
    body = {"model": NAME, "prompt": [whole for _, whole in pairs], "max_tokens": 1,
            "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for (context, whole), choice in zip(pairs, choices):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(whole) + 1  # the prompt, then one answer
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = offline_scores(offline, whole)
        got = lp["token_logprobs"][1:len(whole)]
        assert got == pytest.approx([w for w, _ in want], abs=1e-4)
        ctxlen = len(context)
        score = sum(lp["token_logprobs"][ctxlen:-1])
        assert score == pytest.approx(sum(w for w, _ in want[ctxlen - 1:]), abs=1e-3)
        greedy = all(max(top.values()) == pytest.approx(x, abs=1e-6) for x, top in
                     zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(rank == 1 for _, rank in want[ctxlen - 1:])
        assert choice["text"].startswith(tok.decode(whole))
    assert wait_idle(url)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(served, offline):
    url, _ = served
    ids = offline.engine.tokenizer.encode(CONTEXTS[0] + ENDINGS[0])
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    answer = r.json()
    (choice,) = answer["choices"]
    assert choice["text"] == offline.engine.tokenizer.decode(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                               "total_tokens": len(ids)}
    assert all(len(top) >= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_a_list_of_prompts_is_answered_prompt_major(served, offline):
    """OpenAI's and vLLM's order: index = prompt * n + sample; each answer is the
    offline one for its own prompt (temperature 0)."""
    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompts = ["ROMEO:\n", "JULIET:\n", "HAMLET:\n"]
    answer = client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=8,
                                       temperature=0, echo=True)
    assert sorted(c.index for c in answer.choices) == list(range(6))
    outs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)
    for c in answer.choices:
        prompt = prompts[c.index // 2]
        assert c.text == prompt + outs[c.index // 2].outputs[0].text
    assert answer.usage.completion_tokens == 2 * sum(
        len(o.outputs[0].token_ids) for o in outs)
    assert answer.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert wait_idle(url)


def test_a_list_of_prompts_follows_its_first_prompt(served, monkeypatch):
    """Issue 71, M2: the prompts after the first are sent to the engine as following
    the first (chapter 4's scheduler lets them ride along, as n > 1's extra answers,
    so the list cannot hold every row while another client waits)."""
    url, llm = served
    sent = []
    add = llm.engine.add_request

    def spy(prompt, params=None, request_id=None, arrival_time=None, **extras):
        rid = add(prompt, params, request_id, arrival_time, **extras)
        sent.append((rid, extras))
        return rid
    monkeypatch.setattr(llm.engine, "add_request", spy)
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": ["ROMEO:", "JULIET:", "NURSE:"], "max_tokens": 2})
    assert r.status_code == 200, r.text
    (first, own), *rest = sent
    assert "follows" not in own and [e["follows"] for _, e in rest] == [first] * 2


def test_a_streamed_echo_sends_the_prompt_first(served):
    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chunks = list(client.completions.create(model=NAME, prompt="ROMEO:\n", echo=True,
                                            max_tokens=6, temperature=0, stream=True,
                                            logprobs=1))
    first = next(c for c in chunks if c.choices)
    assert first.choices[0].text.startswith("ROMEO:\n")
    assert first.choices[0].logprobs.token_logprobs[0] is None
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith("ROMEO:\n") and len(text) > len("ROMEO:\n")


def test_a_refused_prompt_leaves_nothing_running(served, offline):
    """The second prompt cannot fit with max_tokens: a 400 naming it, and the first,
    already handed to the engine, is aborted."""
    url, llm = served
    long = list(range(5, 5 + llm.engine.max_model_len - 4))
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": [[5, 6, 7], long], "max_tokens": 8})
    assert r.status_code == 400, r.text
    assert wait_idle(url) and not llm.engine.requests


def test_tokenizer_info_answers_what_lm_eval_reads(served, offline):
    url, _ = served
    info = httpx.get(url + "/tokenizer_info").json()
    tok = offline.engine.tokenizer
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["tokenizer_class"] and info["model_max_length"] > 0
    assert info["chat_template"] == tok.chat_template


def test_the_character_bound_refuses_what_cannot_fit_and_nothing_that_can(served):
    """Before: 4 x the longest token x max_model_len characters passed the pre-check
    (2.6 million for SmolLM2, 80 times what fits), and were tokenized before the
    refusal. Now the bound is the longest token's characters x max_model_len: a text
    of the longest token repeated until the context is full still passes it."""
    from minillm.serve.app import merged_chars, prompt_char_limit
    url, llm = served
    tok, engine = llm.engine.tokenizer, llm.engine
    longest = max(range(len(tok)), key=lambda i: len(tok.token_bytes(i)))
    width = len(tok.token_bytes(longest))
    assert merged_chars(tok) == 1  # no normalizer
    assert prompt_char_limit(engine) == width * engine.max_model_len
    piece = tok.decode([longest])
    fits = piece * (engine.max_model_len - 8)  # as long as anything that fits
    assert len(fits) <= prompt_char_limit(engine)
    r = httpx.post(url + "/tokenize", json={"prompt": fits, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["count"] <= engine.max_model_len
    over = "a" * (prompt_char_limit(engine) + 1)
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": over})
    assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"]


def test_normalizers_that_merge_characters_widen_the_bound():
    from minillm.serve.app import merged_chars

    class Tok:
        normalizers = [{"type": "NFC"}, {"type": "Replace", "pattern": {"String": "  "},
                                         "content": " "}]
    assert merged_chars(Tok) == 8 and merged_chars(object()) == 4


def test_a_response_too_large_is_refused_before_any_work(served):
    """Before: n=128 with prompt_logprobs=20 on a 2,000-token prompt made a 368 MB
    response (the prompt's log-probabilities in every answer). The product is bounded
    before the request is queued, and prompt_logprobs come once per prompt."""
    url, llm = served
    prompt = list(range(5, 405))
    r = httpx.post(url + "/v1/completions", json={
        "model": NAME, "prompt": prompt, "n": 128, "echo": True, "logprobs": 20,
        "max_tokens": 16})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logprobs" and "1,118,208" in error["message"]
    assert wait_idle(url) and not llm.engine.requests
    r = httpx.post(url + "/v1/completions", json={  # 128 x 2 answer tokens, fine
        "model": NAME, "prompt": prompt, "n": 128, "max_tokens": 2,
        "prompt_logprobs": 20, "temperature": 1.0})
    assert r.status_code == 200, r.text
    carrying = [c for c in r.json()["choices"] if c.get("prompt_logprobs")]
    assert len(carrying) == 1 and len(carrying[0]["prompt_logprobs"]) == 400


def test_a_large_answer_is_written_off_the_event_loop(served):
    """/health answers at once while a response of 800,000 log-probabilities is being
    built and written as JSON (in a worker thread, in pieces). Before, on the event
    loop, /health waited 1.6 s for a response of 540,000; here it takes a few ms."""
    import threading
    import time
    url, _ = served
    body = {"model": NAME, "prompt": list(range(5, 405)), "n": 96, "echo": True,
            "logprobs": 20, "max_tokens": 4, "temperature": 1.0}
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(url + "/v1/completions", json=body, timeout=300)))
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t = time.perf_counter()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        slowest = max(slowest, time.perf_counter() - t)
        time.sleep(0.05)
    worker.join()
    assert result["r"].status_code == 200 and len(result["r"].json()["choices"]) == 96
    assert slowest < 1.0, slowest


def test_streamed_echo_logprobs_are_built_once_and_off_the_event_loop(served,
                                                                      monkeypatch):
    """A streamed echo with logprobs: each prompt's logprobs are built once for its n
    answers (they were rebuilt for each), in a worker thread (they were built on the
    event loop: /health waited 3.1 s behind a large one)."""
    import asyncio

    from minillm.serve import app
    calls, build = [], app.echo_logprobs

    def counted(*args):
        calls.append(asyncio._get_running_loop() is None)  # True: off the loop
        return build(*args)
    monkeypatch.setattr(app, "echo_logprobs", counted)
    url, _ = served
    body = {"model": NAME, "prompt": [list(range(5, 105)), list(range(7, 57))],
            "n": 8, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 1.0,
            "stream": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: {")]
    firsts = [c["choices"][0] for c in chunks if len(
        (c["choices"][0]["logprobs"] or {}).get("tokens", ())) >= 50]
    assert sorted(c["index"] for c in firsts) == list(range(16))  # every answer
    assert calls == [True, True]  # once per prompt, each off the event loop


def test_several_prompts_stream_prompt_major(served, offline):
    """stream=true with a list of prompts: each chunk's index is prompt * n + answer,
    and each answer's pieces add up to the offline answer of its prompt."""
    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompts = ["ROMEO:\n", "JULIET:\n", "HAMLET:\n"]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=NAME, prompt=prompts, n=2,
                                           max_tokens=8, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    outs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)
    assert sorted(texts) == list(range(6))
    for index, text in texts.items():
        assert text == outs[index // 2].outputs[0].text
    assert wait_idle(url)
