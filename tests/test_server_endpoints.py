"""Chapter 9's server beyond the two generating routes (issue 38): vLLM's `/tokenize`,
`/detokenize` and `/version`, OpenAI's `/v1/models/{id}`, and `--api-key` (a Bearer
token on every `/v1/*` route, as vLLM; `/health` and `/metrics` stay open). Raw HTTP
with httpx, plus the `openai` client where it has a method for the route."""
from __future__ import annotations


import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers import post
from test_serve import NAME, tiny_llm

import minillm
from minillm.serve.app import build_app
from minillm.serve.cli import BackgroundServer

KEY = "sk-test-key"
SLASHED = "org/tiny"  # a Hub-style name: /v1/models/org/tiny must find it
MESSAGES = [{"role": "user", "content": "Is this a dagger?"}]




@pytest.fixture(scope="module")
def locked():
    """A server with an API key, serving a name with a slash in it."""
    llm = tiny_llm(max_num_seqs=4)
    with BackgroundServer(build_app(llm, SLASHED, api_key=KEY)) as server:
        yield server.url
    assert not llm.engine.requests and not llm.engine.has_unfinished()




def assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# --- /tokenize and /detokenize -----------------------------------------------------

def test_tokenize_a_prompt_as_the_completions_route_does(served):
    url, engine = served
    tok = engine.tokenizer
    r = post(url, "/tokenize", {"model": NAME, "prompt": "ROMEO:\nBut soft"})
    assert r.status_code == 200, r.text
    ids = tok.encode("ROMEO:\nBut soft")
    assert r.json() == {"tokens": ids, "count": len(ids),
                        "max_model_len": engine.max_model_len, "token_strs": None}
    r = post(url, "/tokenize", {"prompt": "ROMEO:\nBut soft",  # model is optional
                                "add_special_tokens": False})
    bare = tok.encode("ROMEO:\nBut soft", add_special_tokens=False)
    assert r.json()["tokens"] == bare
    usage = post(url, "/v1/completions", {"model": NAME, "prompt": "ROMEO:\nBut soft",
                                          "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)


def test_tokenize_messages_as_the_chat_route_does(served):
    url, engine = served
    r = post(url, "/tokenize", {"model": NAME, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    want = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    chat = post(url, "/v1/chat/completions",
                {"model": NAME, "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(want)
    bare = post(url, "/tokenize",
                {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare.json()["tokens"] == engine.tokenizer.apply_chat_template(MESSAGES)


def test_detokenize_gives_the_text_back(served):
    url, engine = served
    ids = engine.tokenizer.encode("JULIET:\nO Romeo, Romeo!", add_special_tokens=False)
    r = post(url, "/detokenize", {"model": NAME, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "JULIET:\nO Romeo, Romeo!"}
    assert post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"model": NAME}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": ["hi"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, 400,
     "return_token_strs"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_tokenize_requests_are_openai_errors(served, path, body, status, param):
    assert_error(post(served[0], path, body), status, param)


# --- /version and /v1/models/{id} ----------------------------------------------------

def test_version(served):
    r = httpx.get(served[0] + "/version")
    assert r.status_code == 200 and r.json() == {"version": minillm.__version__}


def test_retrieve_the_served_model_and_404_for_another(served):
    url, engine = served
    r = httpx.get(url + f"/v1/models/{NAME}")
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["id"] == NAME and card["object"] == "model"
    assert card["max_model_len"] == engine.max_model_len
    assert card == {**httpx.get(url + "/v1/models").json()["data"][0],
                    "created": card["created"]}
    assert_error(httpx.get(url + "/v1/models/gpt-4"), 404, "model", "model_not_found")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


# --- --api-key -----------------------------------------------------------------------

BODY = {"model": SLASHED, "prompt": "ROMEO:\n", "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}])
def test_v1_routes_need_the_bearer_key(locked, headers):
    for r in [httpx.get(locked + "/v1/models", headers=headers),
              httpx.get(locked + f"/v1/models/{SLASHED}", headers=headers),
              post(locked, "/v1/completions", BODY, headers=headers),
              post(locked, "/v1/chat/completions",
                   {"model": SLASHED, "messages": MESSAGES}, headers=headers)]:
        assert_error(r, 401, None, "invalid_api_key")


def test_the_right_key_opens_v1_and_the_rest_stays_open(locked):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(locked + "/v1/models", headers=auth).status_code == 200
    r = httpx.get(locked + f"/v1/models/{SLASHED}", headers=auth)
    assert r.status_code == 200 and r.json()["id"] == SLASHED
    assert post(locked, "/v1/completions", BODY, headers=auth).status_code == 200
    for path in ["/health", "/metrics", "/version"]:  # as vLLM: only /v1/* is locked
        assert httpx.get(locked + path).status_code == 200, path


def test_the_openai_client_with_and_without_the_key(locked):
    good = openai.OpenAI(base_url=locked + "/v1", api_key=KEY, max_retries=0)
    assert good.models.retrieve(SLASHED).id == SLASHED
    done = good.completions.create(**BODY)
    assert done.choices[0].finish_reason in ("length", "stop")
    bad = openai.OpenAI(base_url=locked + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(**BODY)


def test_a_bad_api_key_argument_is_refused():
    llm = tiny_llm(max_num_seqs=1)
    for key in ["", 123]:
        with pytest.raises(ValueError, match="api_key"):
            build_app(llm, NAME, api_key=key)
