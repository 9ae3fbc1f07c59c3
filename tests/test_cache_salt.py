"""The per-request seam (issue 70, part 3) and its first user, vLLM's cache_salt:
add_request(..., **extras) checked by REQUEST_EXTRAS and kept in seq.extras; the paged
cache starts each request's chain of block hashes from its BLOCK_KEY_EXTRAS. Requests
with different salts never share prefix-cache blocks; requests with the same salt do;
offline (add_request, a prompt dict) and on both server endpoints."""
from __future__ import annotations

import httpx
import pytest
import torch

from minillm import LLM
from minillm.engine import LLMEngine
from minillm.kv.blocks import BlockManager
from minillm.model.loader import load_model
from minillm.sampling import SamplingParams
from minillm.utils import bundled_model_path

PROMPT = list(range(10, 58))  # 48 tokens: 11 full blocks of 4 usable
GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def model():
    return load_model(bundled_model_path(), dtype=torch.float32)


def paged(model, **kw) -> LLMEngine:
    return LLMEngine(model, kv_cache="paged", num_blocks=64, block_size=4, **kw)


def serve(engine, prompt, params=GREEDY, **extras) -> tuple[int, list[int]]:
    """Run one request alone; (blocks the prefix cache gave it, its tokens)."""
    hits = engine.kv.blocks.hits
    rid = engine.add_request(prompt, params, **extras)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop(rid)
    out = out if isinstance(out, list) else [out]
    return engine.kv.blocks.hits - hits, [s.output_ids for s in out]


def test_block_keys_start_from_the_extra_key():
    bm = BlockManager(16, 4)
    plain = bm.block_hashes(list(range(8)))
    salted = bm.block_keys(list(range(8)), extra_key=b"x" * 32)
    assert [h for h, _ in salted] != plain  # every block differs, chained
    assert salted[0][1][0] == b"x" * 32  # the first key starts from it
    assert bm.block_keys(list(range(8)), extra_key=b"") == bm.block_keys(
        list(range(8)))  # b"": the tokens alone, as before


def test_blocks_of_another_salt_are_never_shared():
    bm = BlockManager(32, 4)
    tokens = list(range(13))
    bm.allocate("a", tokens, b"A")
    bm.publish()
    assert bm.cached_prefix(tokens, "b", b"B") == []
    assert bm.cached_prefix(tokens, "c") == []
    assert len(bm.cached_prefix(tokens, "d", b"A")) == 3
    bm.free("a")
    assert "a" not in bm.extra_keys and "a" not in bm.request_keys
    bm.check()


def test_the_salt_isolates_the_prefix_cache(model):
    engine = paged(model)
    assert serve(engine, PROMPT, cache_salt="alice")[0] == 0
    same, tokens = serve(engine, PROMPT, cache_salt="alice")
    assert same == 11  # every usable block of alice's first request
    other, other_tokens = serve(engine, PROMPT, cache_salt="bob")
    none, plain_tokens = serve(engine, PROMPT)
    assert other == 0 and none == 0
    assert tokens == other_tokens == plain_tokens  # the same answer either way
    assert serve(engine, PROMPT)[0] == 11  # no salt shares with no salt
    assert not engine.requests and engine.kv.blocks.extra_keys == {}


def test_n_answers_keep_their_requests_salt(model):
    engine = paged(model)
    serve(engine, PROMPT, cache_salt="alice")
    hits, answers = serve(engine, PROMPT, SamplingParams(n=2, max_tokens=3, seed=1),
                          cache_salt="bob")
    assert hits == 0 and len(answers) == 2
    # answer 1's blocks are bob's: a third bob request finds them, alice does not
    assert serve(engine, PROMPT, cache_salt="bob")[0] == 11


def test_a_preempted_request_keeps_its_salt(model):
    """A pool too small for both: one request gives way, frees its blocks, and is
    admitted again with its salt (its chain starts where it did)."""
    engine = LLMEngine(model, kv_cache="paged", num_blocks=26, block_size=4,
                       max_num_seqs=2)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(PROMPT, long, cache_salt="alice")
    engine.add_request(PROMPT[::-1], long, cache_salt="bob")
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.blocks.extra_keys == {}
    assert serve(engine, PROMPT, cache_salt="alice")[0] > 0  # what the pool kept
    assert serve(engine, PROMPT[::-1], cache_salt="alice")[0] == 0  # bob's


@pytest.mark.parametrize("extras, named", [
    ({"cache_salt": ""}, "cache_salt=''"), ({"cache_salt": 7}, "cache_salt=7"),
    ({"cache_salt": "x" * 1025}, "cache_salt="), ({"lora": 1}, "['lora']")])
def test_bad_extras_are_refused_before_any_work(model, extras, named):
    engine = paged(model)
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        engine.add_request(PROMPT, GREEDY, **extras)
    assert not engine.requests and not engine.scheduler.has_unfinished()


def test_a_prompt_dict_carries_the_salt(model):
    llm = LLM(model, kv_cache="paged", num_blocks=64, block_size=4)
    blocks = llm.engine.kv.blocks
    llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "alice"}, GREEDY,
                 use_tqdm=False)
    before = blocks.hits
    llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": "bob"},
                  {"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    assert blocks.hits == before  # neither shares alice's blocks
    before = blocks.hits
    llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "alice"}, GREEDY,
                 use_tqdm=False)
    assert blocks.hits - before == 11
    with pytest.raises(ValueError, match="'multi_modal_data'"):
        llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {}}, GREEDY)
    stream = llm.stream({"prompt_token_ids": PROMPT, "cache_salt": "carol"}, GREEDY)
    assert "".join(stream) is not None
    assert llm.engine.kv.blocks.extra_keys == {}


def test_both_endpoints_take_the_salt():
    pytest.importorskip("fastapi")
    from minillm.serve.app import build_app
    from minillm.serve.cli import BackgroundServer
    from test_serve import NAME, tiny_llm, wait_idle
    llm = tiny_llm(max_num_seqs=4)
    blocks = llm.engine.kv.blocks
    prompt = "ROMEO:\n" + "O, she doth teach the torches to burn bright! " * 6
    chat = [{"role": "user", "content": prompt}]
    with BackgroundServer(build_app(llm, NAME)) as server:
        def hits(path, **body):
            before = blocks.hits
            r = httpx.post(server.url + path, json={
                "model": NAME, "max_tokens": 2, "temperature": 0, **body}, timeout=60)
            assert r.status_code == 200, r.text
            wait_idle(server.url)
            return blocks.hits - before
        for path, body in [("/v1/completions", {"prompt": prompt}),
                           ("/v1/chat/completions", {"messages": chat})]:
            assert hits(path, cache_salt=f"a-{path}", **body) == 0
            assert hits(path, cache_salt=f"a-{path}", **body) > 0  # same salt
            assert hits(path, cache_salt=f"b-{path}", **body) == 0  # another
            r = httpx.post(server.url + path, json={
                "model": NAME, "cache_salt": "", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert not llm.engine.requests
