"""The engine under hostile use (chapters 4 and 6): streams lose nothing whoever steps
the engine, a request that fails on its own ends with finish_reason "error" while the
others go on, what can never be sampled is refused when it is added, and the prefix
cache never serves K/V that older weights computed. The last test drives all of it at
random (hypothesis) against a small paged engine."""
from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import minillm.engine.runner as runner_module
from helpers import greedy
from minillm.engine import LLM, LLMEngine
from minillm.engine.llm import RequestError
from minillm.model.loader import load_model
from minillm.quant.int8 import quantize
from minillm.tokenizer import Tokenizer

torch.set_num_threads(1)
SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"
PROMPTS = ["ROMEO:\nBut soft, what light", "JULIET:\nO Romeo, Romeo,",
           "KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not"]


@pytest.fixture(scope="module")
def bundled():
    return load_model(SHAKESPEARE, device="cpu"), Tokenizer.from_pretrained(SHAKESPEARE)


@pytest.fixture(scope="module")
def solo(bundled):
    """The text of a request run alone on a fresh engine: the reference."""
    model, tok = bundled
    done = {}

    def run(prompt, params):
        key = (prompt, params)
        if key not in done:
            llm = LLM(model, tok, max_num_seqs=1)
            done[key] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
        return done[key]
    return run


def free_everything(engine: LLMEngine) -> None:
    assert not engine.requests and not engine.has_unfinished()
    reserved, _ = engine.kv.usage()
    assert reserved == 0
    if hasattr(engine.kv, "blocks"):
        engine.kv.blocks.check()
        assert not engine.kv.blocks.tables and not engine.kv.blocks.request_keys


# --- 1. streams lose nothing ---

@pytest.mark.parametrize("kv_cache", ["paged", "slots"])
def test_two_streams_read_in_turn_get_every_character(bundled, solo, kv_cache):
    llm = LLM(*bundled, kv_cache=kv_cache)
    a, b = llm.stream(PROMPTS[0], greedy(40)), llm.stream(PROMPTS[1], greedy(45))
    got = {"a": "", "b": ""}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            try:
                got[name] += next(live[name])
            except StopIteration:
                del live[name]
    assert got["a"] == solo(PROMPTS[0], greedy(40)) and len(got["a"]) > 20
    assert got["b"] == solo(PROMPTS[1], greedy(45))
    free_everything(llm.engine)


def test_generate_while_a_stream_is_paused_loses_none_of_the_stream(bundled, solo):
    llm = LLM(*bundled)
    stream = llm.stream(PROMPTS[0], greedy(40))
    first = next(stream)
    out = llm.generate(PROMPTS[2:], greedy(30), use_tqdm=False)
    assert [o.outputs[0].text for o in out] == [solo(p, greedy(30)) for p in PROMPTS[2:]]
    assert first + "".join(stream) == solo(PROMPTS[0], greedy(40))
    free_everything(llm.engine)


def test_a_bad_stream_raises_when_it_is_made(bundled):
    llm = LLM(*bundled)
    with pytest.raises(ValueError, match="empty"):
        llm.stream("", greedy(4))  # not at the first next()
    with pytest.raises(ValueError, match="max_tokens"):
        llm.stream(PROMPTS[0], greedy(10**6))
    free_everything(llm.engine)


def test_a_stream_never_read_or_left_early_frees_its_request(bundled):
    llm = LLM(*bundled)
    llm.stream(PROMPTS[0], greedy(20))  # dropped at once
    gc.collect()
    stream = llm.stream(PROMPTS[1], greedy(20))
    next(stream)
    stream.close()
    stream.close()  # twice is fine
    assert list(stream) == []
    free_everything(llm.engine)


# --- 2. one bad request never stops the others ---

def test_a_request_that_can_never_be_sampled_is_refused_when_added(bundled):
    model, tok = bundled
    engine = LLMEngine(model, tok)
    everything = list(range(model.config.vocab_size))
    with pytest.raises(ValueError, match=r"cover all \d+ token ids.*min_tokens=1"):
        engine.add_request(PROMPTS[0], greedy(5, stop_token_ids=everything,
                                                min_tokens=1))
    free_everything(engine)
    # without min_tokens it can be sampled: the first token stops it
    rid = engine.add_request(PROMPTS[0], greedy(5, stop_token_ids=everything))
    while engine.has_unfinished():
        engine.step()
    assert engine.pop(rid).finish_reason == "stop"


class FlakyTokenizer:
    """The bundled tokenizer, whose decode fails once a marked token appears."""

    def __init__(self, tok, bad_id):
        self.tok, self.bad_id = tok, bad_id

    def encode(self, text):
        return self.tok.encode(text)

    def decode(self, ids):
        if self.bad_id in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken vocabulary")
        return self.tok.decode(ids)


def test_a_tokenizer_error_ends_only_its_request(bundled, solo):
    model, tok = bundled
    victim, other = PROMPTS[2], PROMPTS[1]
    good = solo(other, greedy(30))
    alone = LLM(model, tok).generate([victim, other], greedy(30), use_tqdm=False)
    bad_id = next(t for t in alone[0].outputs[0].token_ids[2:]  # only the victim
                  if t not in alone[1].outputs[0].token_ids  # trips over it
                  + alone[1].prompt_token_ids)
    llm = LLM(model, FlakyTokenizer(tok, bad_id))
    out = [o.outputs[0]
           for o in llm.generate([victim, other], greedy(30), use_tqdm=False)]
    assert out[0].finish_reason == "error" and "UnicodeDecodeError" in out[0].error
    assert 0 < len(out[0].token_ids) < 30  # it stopped where decoding failed
    assert bad_id not in out[0].token_ids  # the token it could not decode: not kept
    assert out[1].text == good and out[1].finish_reason == "length"
    free_everything(llm.engine)


def test_a_row_that_cannot_be_sampled_ends_only_its_request(bundled, solo, monkeypatch):
    model, tok = bundled
    real = runner_module.block_early_stop

    def poison(logits, seqs):  # one request's logits go all -inf
        logits = real(logits, seqs).clone()
        for i, s in enumerate(seqs):
            if s.request_id == "victim" and len(s.output_ids) >= 3:
                logits[i] = float("-inf")
        return logits
    monkeypatch.setattr(runner_module, "block_early_stop", poison)
    engine = LLMEngine(model, tok)
    engine.add_request(PROMPTS[0], greedy(20), request_id="victim")
    engine.add_request(PROMPTS[1], greedy(20), request_id="good")
    while engine.has_unfinished():
        engine.step()
    victim, good = engine.pop("victim"), engine.pop("good")
    assert victim.finish_reason == "error" and "no token can be chosen" in victim.error
    assert len(victim.output_ids) == 3
    assert good.text == solo(PROMPTS[1], greedy(20))
    free_everything(engine)


def test_a_stream_whose_request_fails_raises_after_its_text(bundled, monkeypatch):
    model, tok = bundled
    real = runner_module.block_early_stop

    def poison(logits, seqs):  # from the fourth token on, no token can be sampled
        logits = real(logits, seqs).clone()
        for i, s in enumerate(seqs):
            if len(s.output_ids) >= 3:
                logits[i] = float("-inf")
        return logits
    monkeypatch.setattr(runner_module, "block_early_stop", poison)
    llm = LLM(model, tok)
    stream, text = llm.stream(PROMPTS[2], greedy(10)), ""
    with pytest.raises(RequestError, match="no token can be chosen"):
        for delta in stream:
            text += delta
    assert text  # the three tokens it did get
    free_everything(llm.engine)


def test_abort_of_a_non_string_id_is_a_clear_error(bundled):
    engine = LLMEngine(*bundled)
    with pytest.raises(ValueError, match=r"request_id=\[1\].*strings"):
        engine.abort([1])
    with pytest.raises(KeyError, match="no request 'nope'"):
        engine.abort("nope")


# --- 3. the prefix cache never serves stale K/V ---

def test_quantizing_the_model_in_place_never_reuses_old_kv(bundled):
    model, tok = bundled
    model = copy.deepcopy(model)
    system = "ROMEO:\n" + "But soft, what light through yonder window breaks? " * 3
    llm = LLM(model, tok)
    llm.generate(system + "JULIET:", greedy(20), use_tqdm=False)  # fills the cache
    hits = llm.engine.kv.blocks.hits
    quantize(model, "w8a16")  # the model the engine holds changes under it
    after = llm.generate(system + "ROMEO:", greedy(20), use_tqdm=False)[0]
    fresh = LLM(model, tok).generate(system + "ROMEO:", greedy(20), use_tqdm=False)[0]
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert llm.engine.kv.blocks.hits == hits  # nothing stale was found
    again = llm.generate(system + "HAMLET:", greedy(5), use_tqdm=False)
    assert llm.engine.kv.blocks.hits > hits and again  # the new K/V are shared again


def test_reset_prefix_cache_forgets_every_block(bundled):
    model, tok = bundled
    llm = LLM(model, tok)
    system = "ROMEO:\n" + "But soft, what light through yonder window breaks? " * 3
    llm.generate(system, greedy(4), use_tqdm=False)
    blocks = llm.engine.kv.blocks
    assert blocks.cached
    assert llm.engine.reset_prefix_cache() is True
    assert not blocks.cached and not blocks.key_of
    assert all(h is None for h in blocks.hash_of)
    blocks.check()
    assert LLM(model, tok, kv_cache="slots").engine.reset_prefix_cache() is False


def test_block_names_are_content_hashes_checked_on_a_hit():
    from minillm.kv.blocks import BlockManager
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10, 22))
    hashes = bm.block_hashes(tokens)
    assert len(hashes) == 3 and all(isinstance(h, bytes) and len(h) == 32
                                    for h in hashes)
    assert bm.block_hashes([10, 11, 12, 14] + tokens[4:])[1] != hashes[1]  # chained
    bm.allocate("a", tokens)
    bm.publish()
    assert len(bm.cached_prefix(tokens + [1])) == 3
    first = bm.tables["a"][0]
    bm.key_of[first] = (b"", (10, 11, 12, 99))  # as if another prefix had that hash
    assert bm.cached_prefix(tokens + [1]) == []  # the check on a hit refuses it


# --- all of it at random ---

ACTIONS = st.lists(st.tuples(st.sampled_from(["stream", "generate", "abort", "poison",
                                             "read"]),
                             st.integers(0, 3), st.integers(2, 24)),
                   min_size=3, max_size=10)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(actions=ACTIONS)
def test_interleaved_streams_generates_aborts_and_poison(bundled, solo, actions):
    """Streams read in any order, generate() in between, aborts and requests that
    cannot be sampled: every stream read to its end gets its solo text, every
    generate its solo texts; no block leaks; no step exceeds the budgets."""
    model, tok = bundled
    num_blocks, budget, max_seqs = 24, 128, 3
    llm = LLM(model, tok, max_num_seqs=max_seqs, max_model_len=96, num_blocks=num_blocks,
              block_size=8, max_num_batched_tokens=budget)
    engine = llm.engine
    streams = []  # (stream, prompt, params, text so far)
    everything = list(range(model.config.vocab_size))
    for action, which, n in actions:
        prompt, params = PROMPTS[which], greedy(n)
        if action == "stream":
            streams.append([llm.stream(prompt, params), prompt, params, ""])
        elif action == "generate":
            out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert out.text == solo(prompt, params)
        elif action == "abort" and streams:
            s = streams.pop(which % len(streams))
            s[0].close()
        elif action == "poison":
            with pytest.raises(ValueError, match="no token could ever be sampled"):
                llm.stream(prompt, greedy(n, stop_token_ids=everything, min_tokens=1))
        elif action == "read" and streams:
            s = streams[which % len(streams)]
            s[3] += next(s[0], "")
        assert len(engine.scheduler.running) <= max_seqs
        assert set(engine.kv.blocks.tables) <= set(engine.requests)  # no leak
        engine.kv.blocks.check()
    for s in streams:  # read every stream to its end
        s[3] += "".join(s[0])
        assert s[3] == solo(s[1], s[2])
    assert all(r.tokens <= budget for r in engine.history)
    free_everything(engine)


# --- 4 and 5: every argument checked, in the caller's words, before any work ---

def test_huge_kv_pools_are_refused_before_anything_is_allocated(bundled):
    model, tok = bundled
    cases = [(dict(kv_cache="paged", num_blocks=10**12), r"num_blocks=10{12}"),
             (dict(kv_cache="paged", kv_cache_bytes=10**15), r"kv_cache_bytes=10{15}"),
             (dict(kv_cache="slots", max_num_seqs=60_000), r"max_num_seqs=60000 slots")]
    # (the paged default pool stops at a ceiling: tests/test_kv_memory.py)
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as e:  # 10{12}: 1 and 12 zeros
            LLMEngine(model, tok, **kwargs)
        assert "GiB free" in str(e.value)


@pytest.mark.parametrize("call, match", [
    (lambda m, t: LLMEngine("not a model"), "not a minillm Transformer"),
    (lambda m, t: LLMEngine(m, object()), "lacks encode"),
    (lambda m, t: LLM(m, t, dtype=torch.float16), "apply when LLM loads a folder"),
    (lambda m, t: LLM(m, t, device="cpu"), "apply when LLM loads a folder"),
    (lambda m, t: LLM(m, t, quantization="int8"), "apply when LLM loads a folder"),
    (lambda m, t: LLM(m, t, enable_prefix_caching="no"), "enable_prefix_caching='no'"),
    (lambda m, t: LLM(m, t).generate({"a": 1}, use_tqdm=False), "prompts="),
    (lambda m, t: LLM(m, t).generate(None), "prompts=None"),
    (lambda m, t: LLM(m, t).generate("ROMEO:", use_tqdm="no"), "use_tqdm='no'"),
    (lambda m, t: LLMEngine(m, t).add_request("ROMEO:", arrival_time="yesterday"),
     "arrival_time='yesterday'"),
    (lambda m, t: LLMEngine(m, t).add_request("ROMEO:", arrival_time=1e18),
     "not in the future"),
])
def test_bad_arguments_get_a_clear_error(bundled, call, match):
    with pytest.raises(ValueError, match=match):
        call(*bundled)


def test_graph_buckets_must_be_ints(bundled):
    with pytest.raises(ValueError, match=r"cuda_graphs: buckets=\[1.5\]"):
        LLMEngine(*bundled, kv_cache="slots", cuda_graphs={"buckets": [1.5]})


def test_llm_loads_a_folder_in_int8(bundled):
    llm = LLM(str(SHAKESPEARE), quantization="int8")
    from minillm.quant.int8 import is_quantized
    assert is_quantized(llm.engine.model)
    assert llm.generate("ROMEO:\n", greedy(5), use_tqdm=False)[0].outputs[0].token_ids


# --- 6. records ---

def test_step_records_count_what_the_forward_computed(bundled):
    model, tok = bundled
    engine = LLMEngine(model, tok, kv_cache="paged", block_size=8, num_blocks=64)
    system = list(range(40, 80))  # 40 tokens: 5 full blocks
    engine.add_request(system + [5, 6, 7], greedy(2))
    while engine.has_unfinished():
        engine.step()
    engine.add_request(system + [9, 9], greedy(2))  # its first 40 tokens are cached
    engine.step()
    record = engine.history[-1]
    assert record.is_prefill and record.useful_tokens == 2 and record.tokens == 2
    engine.add_request([1, 2, 3], greedy(2))
    engine.add_request(list(range(100, 110)), greedy(2))
    engine.step()  # the two new ones join the running one's decode token
    record = engine.history[-1]
    assert record.is_prefill and record.rows == 3
    assert record.useful_tokens == record.tokens == 1 + 3 + 10  # packed: no padding
    while engine.has_unfinished():
        engine.step()


def test_history_stays_bounded(bundled, monkeypatch):
    model, tok = bundled
    engine = LLMEngine(model, tok)
    monkeypatch.setattr(LLMEngine, "MAX_HISTORY", 8)
    engine.add_request("ROMEO:\n", greedy(30))
    while engine.has_unfinished():
        engine.step()
    assert 4 <= len(engine.history) <= 8
    assert engine.history[-1].end >= engine.history[0].end


# --- 5 (INT8): NaN weights and bad ids are refused ---

def test_quantize_refuses_nan_or_inf_weights_and_changes_nothing(bundled):
    model = copy.deepcopy(bundled[0])
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight[3, 7] = float("nan")
    for mode in ("w8a16", "w8a8", "fbgemm"):
        with pytest.raises(ValueError, match=r"layers.1.mlp.up_proj.weight holds NaN"):
            quantize(model, mode)
        assert type(model.layers[0].mlp.up_proj) is torch.nn.Linear


@pytest.mark.parametrize("ids, window, match", [
    ([1.5, 2.0, 3.0], 8, "dtype torch.float"),
    ([1, 2, 10**6], 8, r"token ids are in \[0, 4096\)"),
    ([1, -2, 3], 8, r"token ids are in"),
    ([1, 2, 3], 10**6, "longer than the model's context"),
])
def test_perplexity_refuses_what_is_not_token_ids(bundled, ids, window, match):
    from minillm.quant.int8 import perplexity
    with pytest.raises(ValueError, match=match):
        perplexity(bundled[0], ids, window)


# --- 4 (commands): a bad value is a usage error, never a run that grows ---

@pytest.mark.parametrize("module, argv, match", [
    ("serving", ["--requests", "100000000"], "at most 100000"),
    ("paged", ["--requests", "100000000"], "at most 100000"),
    ("decode", ["--batch", "1", "100000000"], "at most 4096"),
    ("serving", ["--max-num-seqs", "60000", "--methods",
                               "minillm-continuous"],
     "GiB free"),
    ("serving", ["--max-num-seqs", "100000000", "--methods",
                               "minillm-continuous"],
     "max_num_seqs=100000000: must be an int in 1..65536"),
])
def test_commands_refuse_what_would_not_fit(module, argv, match):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "minillm.bench", module, *argv, "--no-csv"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and match in r.stderr


def test_unknown_engine_options_are_named(bundled):
    with pytest.raises(ValueError, match=r"\['bogus'\]: not an option.*num_blocks"):
        LLMEngine(*bundled, bogus=1)
    with pytest.raises(ValueError, match="max_model_len='x'"):
        LLMEngine(*bundled, max_model_len="x")
    with pytest.raises(ValueError, match=r"request_id=\[1\]"):
        LLMEngine(*bundled).pop([1])


def test_a_request_whose_recompute_would_break_the_token_budget_is_refused(bundled):
    """A preempted request is computed again in one step (prompt and output): without
    chunked prefill it must fit max_num_batched_tokens, as vLLM requires."""
    model, tok = bundled
    engine = LLMEngine(model, tok, kv_cache="paged", num_blocks=14, block_size=4,
                       max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"= 41 tokens: after a preemption.*=32 is less"):
        engine.add_request(list(range(1, 10)), greedy(32))
    free_everything(engine)
    for i in range(3):  # 24 + 8 = 32 tokens each, in a pool of 56 positions: preempts
        prompt = list(range(1 + 30 * i, 25 + 30 * i))  # no shared prefix
        engine.add_request(prompt, greedy(8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert all(r.tokens <= 32 for r in engine.history)
