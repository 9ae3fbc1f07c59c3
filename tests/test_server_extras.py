"""Issue 38, the rest of the server's front door: OpenAI's `logit_bias` on both generating
routes (JSON keys are strings of token ids; bad keys or values are a 400 naming the field),
byte-fallback tokens in logprobs (completions keys them as OpenAI does, "bytes:\\xe4",
instead of letting them collide on U+FFFD; chat's `bytes` are the token's own), and a
/docs page that works offline (no asset from a CDN). The `openai` client and raw HTTP."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers import post
from test_serve import NAME

from minillm.sequence import Logprob
from minillm.serve.app import chat_logprobs, completion_logprobs

CHAT = [{"role": "user", "content": "Is this a dagger?"}]




@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)




# --- logit_bias ----------------------------------------------------------------------

def test_a_full_bias_makes_greedy_completions_pick_that_token(served, client):
    url, engine = served
    token = engine.tokenizer.encode(" light", add_special_tokens=False)[-1]
    r = client.completions.create(model=NAME, prompt="ROMEO:\n", max_tokens=3,
                                  temperature=0, logit_bias={str(token): 100},
                                  logprobs=1)
    want = engine.tokenizer.decode([token] * 3)
    assert r.choices[0].text == want
    plain = client.completions.create(model=NAME, prompt="ROMEO:\n", max_tokens=1,
                                      temperature=0)
    first = engine.tokenizer.encode(plain.choices[0].text,
                                    add_special_tokens=False)[0]
    banned = client.completions.create(model=NAME, prompt="ROMEO:\n", max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_a_full_bias_makes_greedy_chat_pick_that_token(served, client):
    url, engine = served
    token = engine.tokenizer.encode(" dagger", add_special_tokens=False)[-1]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2,
                                       temperature=0, logit_bias={str(token): 100})
    assert r.choices[0].message.content == engine.tokenizer.decode([token] * 2)


@pytest.mark.parametrize("bias, words", [
    ({"50": 101}, ["logit_bias", "[-100, 100]"]),
    ({"50": -1000}, ["logit_bias", "[-100, 100]"]),
    ({"fifty": 5}, ["logit_bias", "'fifty'"]),
    ({"-3": 5}, ["logit_bias", "'-3'"]),
    ({"50": "5"}, ["logit_bias", "'5'"]),
    ({"50": True}, ["logit_bias"]),
    ({"99999999": 5}, ["logit_bias", "99999999", "outside the vocabulary"]),
    ({str(i): 1 for i in range(1025)}, ["logit_bias", "at most 1024"]),
    ([1, 2], ["logit_bias"]),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_a_400_naming_it(served, path, bias, words):
    url, engine = served
    body = ({"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 2}
            if "chat" not in path else
            {"model": NAME, "messages": CHAT, "max_tokens": 2})
    r = post(url, path, {**body, "logit_bias": bias})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias", error
    for word in words:
        assert word in error["message"], error
    assert not engine.requests


# --- byte-fallback tokens in logprobs ----------------------------------------------

def byte_tokens(tok) -> list[int]:
    """Tokens that are part of a character (a lone UTF-8 byte >= 0x80)."""
    out = []
    for i in range(len(tok)):
        try:
            tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    return out


def test_completions_keys_byte_tokens_by_their_bytes(served):
    engine = served[1]
    tok = engine.tokenizer
    ids = byte_tokens(tok)[:4]
    assert all(tok.decode([i]) == "\ufffd" for i in ids)  # all the same text
    top = {t: Logprob(-1.0 - r, r + 1, tok.decode([t])) for r, t in enumerate(ids)}
    c = SimpleNamespace(token_ids=[ids[0]], logprobs=[top])
    out = completion_logprobs(SimpleNamespace(tokenizer=tok), c, 0)
    keys = list(out["top_logprobs"][0])
    assert len(keys) == 4, keys  # no collision
    want = ["bytes:" + "".join(f"\\x{b:02x}" for b in tok.token_bytes(t)) for t in ids]
    assert keys == want and out["tokens"] == [want[0]]
    assert re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", keys[0])
    # a whole character keeps its text
    word = tok.encode(" light", add_special_tokens=False)[-1]
    c = SimpleNamespace(token_ids=[word], logprobs=[{word: Logprob(-0.5, 1)}])
    out = completion_logprobs(SimpleNamespace(tokenizer=tok), c, 0)
    assert out["tokens"] == [tok.decode([word])]


def test_chat_logprobs_carry_the_tokens_own_bytes(served):
    engine = served[1]
    tok = engine.tokenizer
    ids = byte_tokens(tok)[:3]
    top = {t: Logprob(-1.0 - r, r + 1, tok.decode([t])) for r, t in enumerate(ids)}
    c = SimpleNamespace(token_ids=[ids[0]], logprobs=[top])
    out = chat_logprobs(SimpleNamespace(tokenizer=tok), c, 3)["content"][0]
    assert out["bytes"] == list(tok.token_bytes(ids[0]))
    assert [e["bytes"] for e in out["top_logprobs"]] == [
        list(tok.token_bytes(t)) for t in ids]


def test_a_generated_byte_token_over_http(served, client):
    url, engine = served
    tok = engine.tokenizer
    first = tok.encode("日", add_special_tokens=False)[0]  # 0xe6: a character's start
    r = client.completions.create(model=NAME, prompt="ROMEO:\n", max_tokens=1,
                                  temperature=0, logit_bias={str(first): 100},
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["bytes:\\xe6"]
    assert len(lp.top_logprobs[0]) >= 1 and "bytes:\\xe6" in lp.top_logprobs[0]
    chat = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=1, temperature=0,
        logit_bias={str(first): 100}, logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs.content[0].bytes == [0xe6]


# --- /docs offline --------------------------------------------------------------------

def test_docs_is_a_self_contained_page(served):
    url, _ = served
    r = httpx.get(url + "/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page), page[:500]
    assert "<script" not in page and "cdn" not in page.lower()
    schema = httpx.get(url + "/openapi.json").json()
    for path, methods in schema["paths"].items():
        assert path in page
        for method, op in methods.items():
            assert method.upper() in page and op["summary"] in page
    assert "/v1/chat/completions" in page and "/v1/completions" in page
    assert httpx.get(url + "/redoc").status_code == 404  # Redoc needs a CDN too


# --- vLLM's prompt_logprobs on completions ---------------------------------------------

def test_completions_return_vllms_prompt_logprobs(served, client):
    url, engine = served
    from test_vllm_sampling_extras import reference_logprobs
    prompt = "ROMEO:\nBut soft"
    ids = engine.tokenizer.encode(prompt)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, n=2,
                                  temperature=0, extra_body={"prompt_logprobs": 2})
    logp = reference_logprobs(engine.model, ids)
    first, second = sorted(r.choices, key=lambda c: c.index)
    assert second.model_extra["prompt_logprobs"] is None  # once per prompt: issue 53
    for choice in [first]:
        got = choice.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for t in range(1, len(ids)):
            entry = {int(k): v for k, v in got[t].items()}
            assert set(entry) == set(logp[t - 1].topk(2).indices.tolist()) | {ids[t]}
            actual = entry[ids[t]]
            assert actual["logprob"] == pytest.approx(logp[t - 1, ids[t]].item(),
                                                      abs=1e-4)
            assert actual["decoded_token"] == engine.tokenizer.decode([ids[t]])
    plain = post(url, "/v1/completions", {"model": NAME, "prompt": prompt,
                                          "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_a_streamed_completion_sends_prompt_logprobs_once(served):
    url, engine = served
    body = {"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 4, "temperature": 0,
            "stream": True, "prompt_logprobs": 1}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    carrying = [c for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert len(carrying) == 1 and carrying[0] is chunks[0]
    prompt = carrying[0]["choices"][0]["prompt_logprobs"]
    assert len(prompt) == len(engine.tokenizer.encode("ROMEO:\n")) and prompt[0] is None


@pytest.mark.parametrize("value", [21, -1])
def test_bad_prompt_logprobs_is_a_400_naming_it(served, value):
    url, engine = served
    r = post(url, "/v1/completions", {"model": NAME, "prompt": "ROMEO:\n",
                                      "prompt_logprobs": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"
    assert not engine.requests
