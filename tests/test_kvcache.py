"""minillm.kv.contiguous and minillm.generate (chapter 3): the same tokens and logits as the naive loop and transformers,
memory equal to the formula, clear errors before any work, no half-filled cache after one.
The benchmark command (minillm.bench) is tested in test_bench.py."""

import pytest
import torch

from minillm.kv.contiguous import KVCache
from minillm.generate import generate, generate_tokens, stream, watch_input_lengths
from minillm.memory import kv_cache_bytes
from minillm.model.loader import load_model
from minillm.model.transformer import StepMeta
from minillm.model.naive import naive_generate
from minillm.sampling import SamplingParams

from helpers import TINY, hf_greedy, make_model_pair

torch.set_num_threads(1)

FAMILIES = ("llama_gqa_untied", "mistral", "qwen2_bias_tied")
PROMPT = [1, 5, 9, 23, 7, 88, 3, 41, 17]


def step(model, ids, cache):
    """One forward through `cache`: reserve len(ids) positions, then run the model."""
    meta = cache.prepare(ids.shape[1])
    return model(ids, meta.positions, kv=cache, meta=meta)


def last_only(pos):
    return StepMeta(pos, logits_index=torch.full((pos.shape[0],), pos.shape[1] - 1))


def make_model(family: str, folder, **overrides):
    """Random weights drawn wide (greedy decoding wanders instead of repeating one token),
    as a (transformers, minillm) pair."""
    return make_model_pair(folder, family, "wide", **overrides)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_naive_and_transformers(family, tmp_path):
    hf, model = make_model(family, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=40)
    ours = generate(model, PROMPT, params)
    assert len(set(ours)) > 5  # a real sequence, not one token repeated
    assert ours == naive_generate(model, PROMPT, params)
    assert ours == hf_greedy(hf, PROMPT, 40)


def test_seeded_sampling_equals_naive(llama):
    _, model = llama
    for seed in (0, 1):
        params = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, repetition_penalty=1.3,
                                max_tokens=30, seed=seed, ignore_eos=True)
        ours = generate(model, PROMPT, params)
        assert ours == naive_generate(model, PROMPT, params)
        assert ours == generate(model, PROMPT, params)  # the same seed again, the same tokens


def test_per_step_logits_match_full_forward(llama):
    _, model = llama
    cache = KVCache.from_model(model, len(PROMPT) + 25)
    seq = list(PROMPT)
    with torch.inference_mode():
        logits = step(model, torch.tensor([seq]), cache)[:, -1:]
        for _ in range(25):
            pos = torch.arange(len(seq))[None]
            full = model(torch.tensor([seq]), pos, meta=last_only(pos))
            assert (logits - full).abs().max().item() < 1e-4
            seq.append(int(logits[0, -1].argmax()))
            logits = step(model, torch.tensor([[seq[-1]]]), cache)


def test_chunked_prefill_matches_one_prefill(llama):
    """A prompt fed in two chunks (mask offset by the cached prefix) gives the same logits."""
    _, model = llama
    ids = torch.tensor([PROMPT])
    one, two = KVCache.from_model(model, 16), KVCache.from_model(model, 16)
    with torch.inference_mode():
        a = model(ids, torch.arange(9)[None])  # no cache: every position's logits
        step(model, ids[:, :4], two)
        b = step(model, ids[:, 4:], two)  # the last token of the second chunk
        c = step(model, ids, one)
    torch.testing.assert_close(b, a[:, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c, a[:, -1:], atol=1e-5, rtol=1e-5)


def test_cache_shape_dtype_and_memory_formula(llama):
    _, model = llama
    cache = KVCache.from_model(model, 50)
    assert len(cache.k) == len(cache.v) == TINY["num_hidden_layers"]
    # one slot per position, plus the spare slot for padding; kv heads, not query heads
    assert cache.k[0].shape == (50 + 1, TINY["num_key_value_heads"], 16)
    assert cache.rows(0)[0].shape == (1, 50, 2, 16) and cache.pad_slot == 50
    assert cache.k[0].dtype == torch.float32
    for batch, dtype in [(1, torch.float32), (3, torch.float16), (2, torch.bfloat16)]:
        c = KVCache(2, 2, 16, 50, batch_size=batch, dtype=dtype)
        spare = 2 * 2 * 2 * 16 * dtype.itemsize  # K and V of 2 layers: one slot each
        assert c.nbytes == kv_cache_bytes(TINY, 50, batch, dtype) + spare
    assert cache.nbytes == kv_cache_bytes(TINY, 51, 1, torch.float32)
    assert sum(t.untyped_storage().nbytes() for t in cache.k + cache.v) == cache.nbytes
    assert KVCache.from_model(model).max_seq_len == TINY["max_position_embeddings"]


def test_cache_follows_the_model_dtype(tmp_path):
    make_model("qwen2_bias_tied", tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    cache = KVCache.from_model(model, 20)
    assert cache.k[0].dtype == torch.bfloat16 and cache.nbytes == kv_cache_bytes(TINY, 21, 1, "bfloat16")
    out = generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), cache=cache)
    assert len(out) == 5 and cache.length == len(PROMPT) + 4


def test_mask_built_once_per_forward(llama):
    from minillm.kv import attention as kvcache
    _, model = llama
    cache = KVCache.from_model(model, 20)
    seen = []
    original = kvcache.causal_mask

    def spy(meta, S, group=1):
        seen.append(original(meta, S, group))
        return seen[-1]
    kvcache.causal_mask = spy
    try:
        with torch.inference_mode():
            step(model, torch.tensor([PROMPT]), cache)
            step(model, torch.tensor([[4]]), cache)
    finally:
        kvcache.causal_mask = original
    prefill, decode = seen[:2], seen[2:]
    assert prefill[0] is prefill[1] and prefill[0].dtype == torch.bool
    G = model.config.num_heads // model.config.num_kv_heads  # folded query heads
    assert G > 1 and prefill[0].shape == (1, 1, G * len(PROMPT), len(PROMPT))
    tril = torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.equal(prefill[0][0, 0], tril.repeat(G, 1))  # row g * T + t: token t
    assert decode[0] is decode[1] and decode[0].shape == (1, 1, 1, 10) and decode[0].all()


def test_the_cache_is_used_and_reusable(llama):
    hf, model = llama
    with watch_input_lengths(hf) as lengths:  # transformers calls its model with keywords
        hf_greedy(hf, PROMPT, 4)
    assert lengths == [len(PROMPT), 1, 1, 1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cache = KVCache.from_model(model, 64)
    with watch_input_lengths(model) as lengths:
        first = generate(model, PROMPT, params, cache=cache)
    assert lengths == [len(PROMPT)] + [1] * 5  # the last token is never fed back
    assert generate(model, PROMPT, params, cache=cache) == first  # reset() on reuse
    assert generate(model, PROMPT[:3], params, cache=cache) == generate(model, PROMPT[:3], params)


def test_stop_rules_like_the_naive_loop(llama):
    _, model = llama
    free = generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = free[7]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    ours = generate(model, PROMPT, params)
    assert ours == naive_generate(model, PROMPT, params) == free[:free.index(stop) + 1]
    eos = SamplingParams(temperature=0, max_tokens=30)  # EOS (id 2) stops unless ignore_eos
    assert generate(model, PROMPT, eos) == naive_generate(model, PROMPT, eos)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, PROMPT, SamplingParams(stop=["x"]))


def test_bad_input_raises_before_any_forward(llama):
    _, model = llama
    small = KVCache.from_model(model, 12)
    with watch_input_lengths(model) as lengths:
        with pytest.raises(ValueError, match="needs 19 positions"):
            generate(model, PROMPT, SamplingParams(max_tokens=10), cache=small)
        with pytest.raises(ValueError, match="context"):
            generate(model, PROMPT, SamplingParams(max_tokens=120))
        with pytest.raises(ValueError, match="empty"):
            generate(model, [], SamplingParams())
        with pytest.raises(ValueError, match="not token ids"):
            generate(model, [1, 500], SamplingParams())
        with pytest.raises(ValueError, match="batch"):
            generate(model, PROMPT, SamplingParams(max_tokens=3), cache=KVCache.from_model(model, 64, batch_size=2))
        with pytest.raises(ValueError, match="context"):
            KVCache.from_model(model, 129)
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="max_seq_len"):
                KVCache(2, 2, 16, bad)
        with pytest.raises(ValueError, match="prompt"):
            next(stream(model, None, ""))
    assert lengths == []
    with pytest.raises(ValueError, match="cannot add 13 tokens"):
        small.prepare(13)
    small.reset()
    small.prepare(12)
    with pytest.raises(ValueError, match="cannot add 1 tokens"):
        small.prepare(1)
    small.reset()
    meta = small.prepare(3)
    q, k = torch.zeros(1, 4, 4, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"expects \[1, 2, 3, 16\]"):
        small.attend(0, q, k, k, meta)


def test_stream_joins_to_the_decoded_answer(tmp_path):
    from minillm.tokenizer import Tokenizer
    text = "To be, or not to be, that is the question. Ça va? Ünïcödé → 文字 " * 20
    tokenizer = Tokenizer.train([text], 300, progress=False)
    _, model = make_model("llama_gqa_untied", tmp_path, vocab_size=tokenizer.vocab_size,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3)
    pieces = list(stream(model, tokenizer, "To be", params))
    new = generate(model, tokenizer.encode("To be"), params)
    assert "".join(pieces) == tokenizer.decode(new, skip_special_tokens=True)
    assert all(pieces)
    char = next(c for c in "".join(pieces) if not c.isspace())
    stopped = SamplingParams(temperature=1.0, max_tokens=40, seed=3, stop=[char])
    short = list(generate_tokens(model, tokenizer.encode("To be"), stopped, tokenizer))
    assert short == naive_generate(model, tokenizer.encode("To be"), stopped, tokenizer)
    assert short == new[:len(short)] and char in tokenizer.decode(short)


# --- bad input and misuse: a clear error before any work, never a silently wrong cache ---

def no_forward(model):
    """Context: assert that no forward pass of `model` runs inside."""
    return watch_input_lengths(model)


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([PROMPT, PROMPT]), "prompt"),  # 2-D: two prompts, not one
    ([True, False, True], "prompt"),             # bools are not token ids
    (b"\x01\x05\x09", "prompt"),                 # bytes are not token ids
    ([1, -3, 5], "not token ids"),
    ([1.0, 5.0], "not token ids"),
])
def test_bad_prompts_raise_before_any_forward(llama, bad, match):
    _, model = llama
    with no_forward(model) as lengths:
        with pytest.raises(ValueError, match=match):
            generate(model, bad, SamplingParams(max_tokens=3))
    assert lengths == []


def test_non_finite_logits_raise(tmp_path):
    """A model with a NaN weight must not generate token 0 forever: it raises, in both paths."""
    from minillm.sampling import NonFiniteLogitsError
    _, model = make_model("llama_gqa_untied", tmp_path)
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    for params in (SamplingParams(temperature=0, max_tokens=5),
                   SamplingParams(temperature=0.8, max_tokens=5, seed=0)):
        with pytest.raises(NonFiniteLogitsError, match="NaN or inf"):
            generate(model, PROMPT, params)
    with pytest.raises(ValueError):  # NonFiniteLogitsError is a ValueError
        generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=5))


def test_params_and_tokenizer_are_checked(llama):
    _, model = llama
    with no_forward(model) as lengths:
        with pytest.raises(ValueError, match="SamplingParams"):
            generate(model, PROMPT, {"temperature": 0})
        with pytest.raises(ValueError, match="tokenizer=None"):
            next(stream(model, None, "hello"))
        with pytest.raises(ValueError, match="prompt=42"):
            next(stream(model, None, 42))
    assert lengths == []


@pytest.mark.parametrize("make, match", [
    (lambda m: KVCache(3, 2, 16, 64), r"layers, kv_heads.*\(3, 2, 16"),   # layer count
    (lambda m: KVCache(2, 4, 16, 64), r"\(2, 4, 16"),                     # kv heads
    (lambda m: KVCache(2, 2, 8, 64), r"\(2, 2, 8"),                       # head_dim
    (lambda m: KVCache(2, 2, 16, 64, dtype=torch.float16), "float16"),   # dtype
    (lambda m: object(), "cache=object"),                                # not a KVCache
])
def test_a_cache_that_does_not_fit_the_model_is_refused(llama, make, match):
    _, model = llama
    with no_forward(model) as lengths:
        with pytest.raises(ValueError, match=match):
            generate(model, PROMPT, SamplingParams(max_tokens=3), cache=make(model))
    assert lengths == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=torch.int64), "dtype"),
    (dict(dtype="float16"), "dtype"),
    (dict(device="no-such-device"), "device"),
    (dict(batch_size=0), "batch_size"),
])
def test_cache_constructor_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCache(2, 2, 16, 8, **kwargs)


def test_a_cache_larger_than_memory_is_refused_before_allocating():
    from minillm.kv.contiguous import free_memory_bytes
    free = free_memory_bytes("cpu")
    if free is None:
        pytest.skip("this system does not report its free memory")
    with pytest.raises(ValueError, match="GiB"):  # 2**50 bytes: far beyond any machine
        KVCache(32, 8, 128, 2**30, batch_size=2**7, dtype=torch.float16)


def test_prepare_and_attend_refuse_misuse(llama):
    _, model = llama
    cache = KVCache.from_model(model, 20)
    for bad in (True, 2.0, "3"):
        with pytest.raises(ValueError, match="num_tokens"):
            cache.prepare(bad)
    assert cache.length == 0
    meta = cache.prepare(2)
    q, k = torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 2, 16)
    with pytest.raises(ValueError, match="layer_idx=-1"):  # would silently pick the last
        cache.attend(-1, q, k, k, meta)
    with pytest.raises(ValueError, match="layer_idx=2"):
        cache.attend(2, q, k, k, meta)
    with pytest.raises(ValueError, match="StepMeta"):
        cache.attend(0, q, k, k, None)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.attend(0, q, k, k, StepMeta(meta.positions))
    big = KVCache(2, 2, 16, 8, batch_size=2)
    big_meta = big.prepare(2)
    with pytest.raises(ValueError, match=r"expects \[2, 2, 2, 16\]"):
        big.attend(0, q, k, k, big_meta)  # batch 1 into batch 2 would broadcast into both rows
    with pytest.raises(ValueError, match="float32"):
        cache.attend(0, q, k.half(), k.half(), meta)
    with pytest.raises(ValueError, match="v \\[1, 2, 2, 8\\]"):
        cache.attend(0, q, k, torch.zeros(1, 2, 2, 8), meta)


def test_a_second_forward_with_one_meta_is_an_error(llama):
    """One prepare() reserves positions for ONE forward: the last layer uses them up."""
    _, model = llama
    cache = KVCache.from_model(model, 20)
    with torch.inference_mode():
        step(model, torch.tensor([PROMPT]), cache)
        meta = cache.prepare(1)
        model(torch.tensor([[4]]), meta.positions, kv=cache, meta=meta)
        stored = [t.clone() for t in cache.k]
        with pytest.raises(ValueError, match="call prepare"):
            model(torch.tensor([[5]]), meta.positions, kv=cache, meta=meta)  # would overwrite
    assert all(torch.equal(a, b) for a, b in zip(stored, cache.k))


def test_an_error_midway_leaves_the_cache_empty_and_reusable(llama):
    _, model = llama
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = generate(model, PROMPT, params)
    cache = KVCache.from_model(model, 64)
    calls = []

    def fail_third(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
    handle = model.register_forward_pre_hook(fail_third)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            generate(model, PROMPT, params, cache=cache)
    finally:
        handle.remove()
    assert cache.length == 0 and cache.owner is None
    assert generate(model, PROMPT, params, cache=cache) == expected


def test_stopping_early_resets_the_cache(llama):
    _, model = llama
    cache = KVCache.from_model(model, 64)
    tokens = generate_tokens(model, PROMPT, SamplingParams(max_tokens=8), cache=cache)
    next(tokens), next(tokens)
    assert cache.length == len(PROMPT) + 1
    tokens.close()  # the caller stops: no half request stays in the cache
    assert cache.length == 0 and cache.owner is None


def test_two_generations_on_one_cache_do_not_mix(llama):
    _, model = llama
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    other = [3, 4, 5, 6]
    cache = KVCache.from_model(model, 64)
    first = generate_tokens(model, PROMPT, params, cache=cache)
    next(first)
    assert generate(model, other, params, cache=cache) == generate(model, other, params)
    with pytest.raises(RuntimeError, match="another generation"):
        next(first)
    assert generate(model, PROMPT, params, cache=cache) == generate(model, PROMPT, params)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_grouped_query_attention_never_copies_k_and_v(llama, kv_cache, monkeypatch):
    """Through every cache, SDPA gets as many query heads as K/V heads (the query heads
    of a K/V head folded into its rows) and no enable_gqa, whose general kernel would
    repeat K and V per query head; the tokens stay transformers' (test_engine)."""
    from minillm.engine import LLMEngine
    from minillm.kv import attention as contiguous
    from minillm.sampling import SamplingParams
    _, model = llama
    assert model.config.num_heads > model.config.num_kv_heads  # a GQA model
    calls = []
    real = contiguous.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)
    monkeypatch.setattr(contiguous.F, "scaled_dot_product_attention", spy)
    engine = LLMEngine(model, max_num_seqs=2, kv_cache=kv_cache)
    for prompt in ([1, 5, 9, 4], [1, 7]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    monkeypatch.undo()
    assert calls and all(h == kv and not gqa for h, kv, gqa in calls), calls


def test_a_request_longer_than_a_slot_is_refused_with_both_lengths():
    """The slots backend's message names the row's length (it once printed a literal
    '{self.max_seq_len}')."""
    from minillm.kv.slots import SlotKVCache
    from minillm.sequence import Sequence
    from minillm.utils import bundled_model_path
    model = load_model(bundled_model_path())
    kv = SlotKVCache.from_model(model, max_num_seqs=2, max_seq_len=16)
    seq = Sequence.create(model, [1] * 10, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match=r"needs 30 positions; a row holds 16$"):
        kv.allocate(seq)
    assert kv.too_long(seq).endswith("a row holds 16")
    assert kv.free_rows == [0, 1] and not kv.row_of  # nothing taken
