"""minillm.engine (chapter 4): continuous batching gives every request the tokens it gets
alone. KV backends pass one conformance check (rows of different lengths, padding, decode);
the engine matches `generate` for greedy and seeded sampling whatever the batch around a
request; bad requests change nothing; a long random run of add/step/abort leaks nothing."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helpers import answer_text, drive, greedy
from minillm.engine import LLM as _LLM, LLMEngine as _LLMEngine
from minillm.kv.paged import PagedKVCache
from minillm.kv.slots import SlotKVCache
from minillm.kv.contiguous import KVCache
from minillm.generate import generate
from minillm.model.loader import load_model
from minillm.model.transformer import StepMeta
from minillm.sampling import SamplingParams
from minillm.sequence import Sequence
from minillm.tokenizer import Tokenizer

torch.set_num_threads(1)


def LLMEngine(*args, **kwargs):  # chapter 4's backend: these tests read its rows
    return _LLMEngine(*args, **{"kv_cache": "slots", **kwargs})


def LLM(*args, **kwargs):
    return _LLM(*args, **{"kv_cache": "slots", **kwargs})

SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"
EOS = 2  # the EOS id of the TINY models of helpers.py


@pytest.fixture(scope="module")
def model(llama):
    return llama[1]


@pytest.fixture(scope="module")
def shakespeare():
    """(model, tokenizer) of the bundled model: real text for stop strings and the LLM."""
    return load_model(SHAKESPEARE, device="cpu"), Tokenizer.from_pretrained(SHAKESPEARE)


class Solo:
    """`generate` run alone, once per (prompt, params): the reference of every test."""
    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer, self.done = model, tokenizer, {}

    def __call__(self, prompt, params) -> list[int]:
        key = (tuple(prompt), params)
        if key not in self.done:
            self.done[key] = generate(self.model, list(prompt), params, self.tokenizer)
        return self.done[key]


def state(engine: LLMEngine) -> tuple:
    """Everything a rejected request must leave as it was."""
    s = engine.scheduler
    return (dict(engine.requests), [q.request_id for q in s.waiting],
            [q.request_id for q in s.running], dict(engine.kv.row_of), engine.kv.num_free,
            sorted(engine.runner.generators))


def assert_drained(engine: LLMEngine) -> None:
    """No request left anywhere, no row or block held: nothing leaked."""
    assert not engine.has_unfinished()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.kv.usage()[0] == 0
    if hasattr(engine.kv, "row_of"):  # chapter 4's slots
        assert engine.kv.row_of == {} and engine.kv.num_free == engine.kv.batch_size
    else:  # the default backend: chapter 6's blocks
        blocks = engine.kv.blocks
        blocks.check()
        assert not blocks.tables and not blocks.request_keys and not blocks.pending
        assert engine.kv.num_free == engine.kv.num_blocks
    assert engine.runner.generators == {}


# --- 1. KV backend conformance -------------------------------------------------------------

class ContiguousRows:
    """Chapter 3's KVCache: batch row i is cache row i (block_tables None)."""
    def __init__(self, model, batch: int, max_len: int):
        self.kv = KVCache.from_model(model, max_len, batch_size=batch)
        self.max_len = max_len

    def slots(self, i: int, start: int, end: int) -> list[int]:
        return [i * self.max_len + p for p in range(start, end)]

    def block_tables(self):
        return None


class ShuffledSlotRows:
    """SlotKVCache: batch row i is a request whose row the cache chose; requests are
    admitted in a shuffled order, and one more request holds a row nobody may read."""
    def __init__(self, model, batch: int, max_len: int):
        self.kv = SlotKVCache.from_model(model, batch + 2, max_len)
        config = model.config
        other = Sequence.create(config, [1], greedy(1), request_id="other")
        self.kv.allocate(other)  # takes row 0
        self.seqs = [Sequence.create(config, [1], greedy(1), request_id=f"r{i}")
                     for i in range(batch)]
        order = list(range(batch))
        random.Random(1).shuffle(order)
        for i in order:
            self.kv.allocate(self.seqs[i])
        rows = [self.kv.row_of[s.request_id] for s in self.seqs]
        assert rows != sorted(rows)  # the batch really reads rows out of order

    def slots(self, i: int, start: int, end: int) -> list[int]:
        return self.kv.slots(self.seqs[i], start, end)

    def block_tables(self):
        return torch.tensor([self.kv.block_table(s) for s in self.seqs])


def check_backend(model, make_kv) -> None:
    """A KV backend is right if a batch of rows of different lengths (a right-padded
    prefill, then decode steps) gives each row the logits of a no-cache forward of that row
    alone. max_context=None (read the whole cache, the CUDA-graph path) gives the same.
    make_kv(model, batch, max_len) -> an object with .kv, .slots(i, start, end) (the slots
    of row i's positions) and .block_tables() (a tensor [B, n] or None)."""
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 101) for _ in range(n - 1)] for n in (5, 1, 9, 3)]
    B, T, steps = len(prompts), max(map(len, prompts)), 4
    rows = make_kv(model, B, T + steps + 3)
    kv = rows.kv
    with torch.no_grad():  # garbage where no token was written: reading it must not matter
        for t in kv.k + kv.v:
            t.normal_(0, 100)
    seqs = [list(p) for p in prompts]

    def reference(i: int) -> torch.Tensor:
        """Row i alone, no cache: the logits of every position."""
        ids = torch.tensor([seqs[i]])
        return model(ids, torch.arange(len(seqs[i]))[None])[0]

    def run(ids, positions, slots, lengths, logits_index, max_context):
        meta = StepMeta(positions=torch.tensor(positions), logits_index=logits_index,
                        slot_mapping=torch.tensor(slots),
                        block_tables=rows.block_tables(), max_context=max_context)
        return model(torch.tensor(ids), meta.positions, kv=kv, meta=meta)

    with torch.inference_mode():
        ids = [s + [0] * (T - len(s)) for s in seqs]  # right padding
        positions = [list(range(len(s))) + [0] * (T - len(s)) for s in seqs]
        slots = [rows.slots(i, 0, len(s)) + [kv.pad_slot] * (T - len(s))
                 for i, s in enumerate(seqs)]
        lengths = [len(s) for s in seqs]
        for max_context in (max(lengths), None):  # writing the same K/V twice is harmless
            logits = run(ids, positions, slots, lengths, None, max_context)  # [B, T, V]
            for i, s in enumerate(seqs):
                want = reference(i)
                got = logits[i, :len(s)]
                assert (got - want).abs().max().item() < 1e-4, (i, max_context)
        last = logits[torch.arange(B), torch.tensor(lengths) - 1]
        for _ in range(steps):  # decode: one token per row, each at its own position
            for i, s in enumerate(seqs):
                s.append(int(last[i].argmax()))
            ids = [[s[-1]] for s in seqs]
            positions = [[len(s) - 1] for s in seqs]
            slots = [rows.slots(i, len(s) - 1, len(s)) for i, s in enumerate(seqs)]
            lengths = [len(s) for s in seqs]
            for max_context in (max(lengths), None):
                out = run(ids, positions, slots, lengths, torch.zeros(B, dtype=torch.long),
                          max_context)
                assert out.shape == (B, 1, model.config.vocab_size)
                for i in range(B):
                    diff = (out[i, 0] - reference(i)[-1]).abs().max().item()
                    assert diff < 1e-4, (i, len(seqs[i]), max_context)
            last = out[:, 0]


class FragmentedBlocks:
    """PagedKVCache (chapter 6) with blocks of 4: each row's blocks are scattered over the
    pool (other requests took and gave back blocks first), tables of different lengths."""
    def __init__(self, model, batch: int, max_len: int):
        blocks_per_row = -(-max_len // 4)
        self.kv = PagedKVCache.from_model(model, num_blocks=(batch + 2) * blocks_per_row,
                                          block_size=4, enable_prefix_caching=False)
        bm = self.kv.blocks
        bm.allocate("other", [1] * (3 * blocks_per_row))  # taken, then partly given back
        self.ids = [f"r{i}" for i in range(batch)]
        for rid in self.ids:
            bm.allocate(rid, [1] * 5)  # two blocks each, then more one at a time
        bm.free("other")
        rng = random.Random(2)
        for _ in range(blocks_per_row - 2):
            for rid in rng.sample(self.ids, batch):
                tokens = [1] * (4 * len(bm.tables[rid]) + 1)
                bm.append_slot(rid, tokens)
        flat = [b for rid in self.ids for b in bm.tables[rid]]
        assert flat != sorted(flat)  # really scattered

    def slots(self, i: int, start: int, end: int) -> list[int]:
        table = self.kv.blocks.tables[self.ids[i]]
        return [table[p // 4] * 4 + p % 4 for p in range(start, end)]

    def block_tables(self):
        return torch.tensor([self.kv.blocks.tables[rid] for rid in self.ids])


BACKENDS = {"contiguous": ContiguousRows, "slots_shuffled": ShuffledSlotRows,
            "paged_fragmented": FragmentedBlocks}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_kv_backend_conformance(model, backend):
    check_backend(model, BACKENDS[backend])


# --- 2. the engine, greedy: every request gets its solo tokens -----------------------------

@pytest.fixture(scope="module")
def eos_prompts(model):
    """Prompts whose greedy output reaches EOS within 14 tokens (random weights rarely do)."""
    rng, found = random.Random(5), []
    while len(found) < 3:
        prompt = [1] + [rng.randrange(3, 101) for _ in range(rng.randrange(0, 12))]
        out = generate(model, prompt, greedy(14))
        if out[-1] == EOS and len(out) < 14:
            found.append(prompt)
    return found


def random_requests(rng: random.Random, n: int, spread: int, eos_prompts=()) -> list:
    """(arrival step, prompt, params): prompts of 1 to 20 tokens (some that reach EOS),
    1 to 14 new tokens, EOS on or off."""
    out = []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, 101) for _ in range(rng.randrange(0, 20))]
        if eos_prompts and rng.random() < 0.4:
            prompt = rng.choice(eos_prompts)
        params = greedy(rng.randrange(1, 15), ignore_eos=rng.random() < 0.5)
        out.append((rng.randrange(0, spread + 1), prompt, params))
    return out


@pytest.mark.parametrize("kv_cache", ["slots", None])  # None: the default (paged)
@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 8])
def test_engine_greedy_equals_solo(model, eos_prompts, max_num_seqs, kv_cache):
    solo = Solo(model)
    reasons = []
    for seed, spread in [(0, 0), (1, 6), (2, 20)]:  # all at once, or arriving over steps
        requests = random_requests(random.Random(seed), 12, spread, eos_prompts)
        engine = LLMEngine(model, max_num_seqs=max_num_seqs, kv_cache=kv_cache)
        assert hasattr(engine.kv, "blocks") == (kv_cache is None)  # None: paged
        results = drive(engine, requests)
        for rid, (prompt, params, streamed, seq) in results.items():
            want = solo(prompt, params)
            assert streamed == seq.output_ids == want, (seed, rid)
            reason = "stop" if want[-1] == EOS and not params.ignore_eos else "length"
            assert seq.finish_reason == reason
            reasons.append(reason)
        assert_drained(engine)
        if spread == 0:  # all at once: the first prefill fills every row
            assert engine.history[0].rows == min(max_num_seqs, 12)
        assert all(r.rows <= max_num_seqs for r in engine.history)
    assert "stop" in reasons and "length" in reasons  # EOS really ended some requests


def test_engine_static_policy_equals_solo(model, eos_prompts):
    solo = Solo(model)
    requests = random_requests(random.Random(3), 10, 8, eos_prompts)
    continuous = drive(LLMEngine(model, max_num_seqs=3), requests)
    engine = LLMEngine(model, max_num_seqs=3, policy="static")
    static = drive(engine, requests)
    assert_drained(engine)
    for results in (continuous, static):
        for prompt, params, streamed, seq in results.values():
            assert streamed == seq.output_ids == solo(prompt, params)
    # static keeps finished rows in the batch: it runs more steps, with padding rows
    decode = [r for r in engine.history if not r.is_prefill]
    assert any(r.useful_rows < r.rows for r in decode)


def test_engine_small_token_budget_and_one_row(model):
    """max_num_batched_tokens limits the padded prefill: fewer prompts per prefill, same
    tokens; a one-row engine is a plain loop."""
    solo = Solo(model)
    requests = random_requests(random.Random(4), 8, 0)
    engine = LLMEngine(model, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=40)
    for prompt, params, streamed, seq in drive(engine, requests).values():
        assert streamed == seq.output_ids == solo(prompt, params)
    for r in engine.history:
        assert r.tokens <= 24 or r.rows == 1
    assert engine.kv.max_seq_len == 40
    assert_drained(engine)


# --- 3. sampling: seeded, per-request params honoured ---------------------------------------

def mixed_params(solo_greedy: list[int], tokenizer) -> list[SamplingParams]:
    """One request of each kind; the stop id and the stop string come from the greedy
    output, so that they really end their requests."""
    stop_id = solo_greedy[5]
    text = [tokenizer.decode([t]) for t in solo_greedy]
    # a stop string across a token boundary: the end of token 7, the start of token 8
    stop = text[7][-1] + text[8][:1]
    return [
        greedy(16),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=1),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=2),
        SamplingParams(temperature=1.5, max_tokens=16, seed=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.5, max_tokens=16, seed=4),
        greedy(16, repetition_penalty=1.3),
        greedy(16, stop_token_ids=[stop_id]),
        greedy(16, stop=[stop]),
        SamplingParams(temperature=0.9, min_p=0.05, max_tokens=10, seed=5,
                       stop=["\n"]),
    ]


@pytest.mark.parametrize("kv_cache", ["slots", None])  # None: the default (paged)
def test_sampling_per_request_params_and_seeds(shakespeare, kv_cache):
    model, tok = shakespeare
    solo = Solo(model, tok)
    prompts = [tok.encode(t) for t in ("ROMEO:\nWhat light", "KING", "First Citizen:\n",
                                       "O, she doth teach", "JULIET:\n")]
    base = solo(prompts[0], greedy(16))
    params = mixed_params(base, tok)
    cases = [(prompts[i % len(prompts)], p) for i, p in enumerate(params)]
    cases[6], cases[7] = (prompts[0], params[6]), (prompts[0], params[7])  # from `base`
    runs = []
    for _ in range(2):
        engine = LLMEngine(model, tok, max_num_seqs=4, kv_cache=kv_cache)
        requests = [(i // 3, p, sp) for i, (p, sp) in enumerate(cases)]
        results = drive(engine, requests)
        runs.append({rid: r[2] for rid, r in results.items()})
        for prompt, p, streamed, seq in results.values():
            want = solo(prompt, p)
            assert streamed == seq.output_ids == want, p
            assert seq.text == answer_text(tok, want, p)
    assert runs[0] == runs[1]  # the same seeds, the same tokens
    out = runs[0]
    ids = sorted(out, key=int)
    stop_id = params[6].stop_token_ids[0]
    assert out[ids[6]] == base[:base.index(stop_id) + 1]  # the stop id ends it, kept
    stop = params[7].stop[0]
    assert stop in tok.decode(out[ids[7]]) and stop not in tok.decode(out[ids[7]][:-1])
    assert out[ids[7]] == base[:len(out[ids[7]])] and len(out[ids[7]]) < 16
    assert len({tuple(t) for t in out.values()}) == len(out)  # the params made a difference


# --- 4. bad requests change nothing ---------------------------------------------------------

def test_bad_requests_rejected_and_engine_unchanged(model):
    solo = Solo(model)
    engine = LLMEngine(model, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                       enable_chunked_prefill=False)
    good = [([1, 5, 9], greedy(8, ignore_eos=True)), ([1, 7], greedy(6, ignore_eos=True)),
            ([1, 3, 4, 5], greedy(5, ignore_eos=True))]
    ids = [engine.add_request(p, sp) for p, sp in good]
    engine.step()  # two run, one waits
    bad = [
        (([],), "empty"),
        (([1, 101],), "not token ids"),
        (([1, -1],), "not token ids"),
        (([1] * 10, greedy(60)), "max_model_len=64"),
        (([1, 2], {"temperature": 0}), "SamplingParams"),
        (([1, 2], greedy(4), ids[0]), "unique"),
        (([1, 2], greedy(4), 7), "unique string"),
        (("hello",), "tokenizer"),
        (([1] * 17, greedy(4)), "max_num_batched_tokens=16"),
        (([1, 2], greedy(4, stop=["x"])), "tokenizer"),
        (([1, 2], greedy(4, stop_token_ids=[500])), "stop_token_ids"),
        ((torch.ones(2, 3, dtype=torch.long),), "shape"),
    ]
    for args, message in bad:
        before = state(engine)
        with pytest.raises(ValueError, match=message):
            engine.add_request(*args)
        assert state(engine) == before, args
    full = LLMEngine(model, max_num_seqs=1)
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        full.add_request([1] * 100, greedy(29))
    full.add_request([1] * 100, greedy(28))  # exactly the context: allowed
    with pytest.raises(KeyError, match="nope"):
        engine.abort("nope")
    with pytest.raises(ValueError, match="has not finished"):
        engine.pop(ids[0])
    results = {}
    while engine.has_unfinished():
        engine.step()
    for rid, (prompt, params) in zip(ids, good):
        results[rid] = engine.pop(rid).output_ids
        assert results[rid] == solo(prompt, params)
    assert_drained(engine)


def test_auto_ids_never_collide_with_given_ids(model):
    # BUG (reported to the lead, minillm/engine/llm.py LLMEngine.add_request): the automatic
    # id is str(next(counter)) and is not checked against ids the caller chose, so after
    # add_request(..., request_id="1") the second automatic id "1" is refused with
    # "request_id='1': give a new, unique string" although the caller gave no id.
    engine = LLMEngine(model, max_num_seqs=2)
    engine.add_request([1, 5], greedy(2), request_id="1")
    ids = [engine.add_request([1, 6], greedy(2)) for _ in range(3)]
    assert len(set(ids) | {"1"}) == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": True}, "max_num_seqs"),
    ({"max_num_seqs": 2.0}, "max_num_seqs"),
    ({"max_model_len": 129}, "max_model_len=129"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"policy": "fifo"}, "policy"),
    ({"policy": "fifo", "kv_cache": None}, "policy='fifo'"),  # before the default's lookup
])
def test_bad_engine_args(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(model, **kwargs)


def test_abort_frees_row_at_once(model):
    solo = Solo(model)
    engine = LLMEngine(model, max_num_seqs=2)
    p = greedy(10, ignore_eos=True)
    a, b, c = (engine.add_request(prompt, p) for prompt in ([1, 5], [1, 6, 7], [1, 8]))
    engine.step()  # a and b hold both rows, c waits
    assert engine.kv.num_free == 0 and set(engine.kv.row_of) == {a, b}
    out = engine.abort(a)
    assert (out.request_id, out.finished, out.outputs[0].finish_reason) == (a, True,
                                                                           "abort")
    assert engine.kv.num_free == 1 and a not in engine.kv.row_of
    assert engine.requests[a].finish_reason == "abort"
    assert engine.abort(a).outputs[0].finish_reason == "abort"  # again: no change
    d = engine.add_request([1, 9], p)
    assert engine.abort(d).outputs[0].finish_reason == "abort"  # a waiting request
    assert d not in [s.request_id for s in engine.scheduler.waiting]
    engine.step()  # c takes a's row
    assert set(engine.kv.row_of) == {b, c}
    while engine.has_unfinished():
        engine.step()
    seq_a = engine.pop(a)
    assert seq_a.output_ids == solo([1, 5], p)[:1]  # the token it had, no more
    assert engine.pop(d).output_ids == []
    assert engine.pop(b).output_ids == solo([1, 6, 7], p)
    assert engine.pop(c).output_ids == solo([1, 8], p)
    assert_drained(engine)


def test_llm_generate_bad_prompt_queues_nothing(model):
    llm = LLM(model, max_num_seqs=2)
    good = greedy(5)
    with pytest.raises(ValueError, match="not token ids"):
        llm.generate([[1, 5, 6], [1, 4], [1, 200], [1, 3]], good, use_tqdm=False)
    assert llm.engine.requests == {}
    assert_drained(llm.engine)
    with pytest.raises(ValueError, match="2 params for 3 prompts"):
        llm.generate([[1, 5], [1, 6], [1, 7]], [good, good], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([], good, use_tqdm=False)
    assert_drained(llm.engine)
    outs = llm.generate([[1, 5, 6], [1, 4]], good, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [generate(model, [1, 5, 6], good),
                                          generate(model, [1, 4], good)]


# --- 5. a long random run: no leak, every finished request right ----------------------------

@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_random_add_step_abort(model, eos_prompts, policy):
    rng = random.Random(2024 if policy == "continuous" else 7)
    solo = Solo(model)
    engine = LLMEngine(model, max_num_seqs=3, max_num_batched_tokens=12, policy=policy)
    prompts = [[1] + [rng.randrange(3, 101) for _ in range(rng.randrange(0, 10))]
               for _ in range(12)] + eos_prompts
    params = [greedy(n, ignore_eos=e) for n in (1, 2, 3, 5) for e in (False, True)]
    known, popped, counts = {}, {}, {"add": 0, "step": 0, "abort": 0, "pop": 0}
    for _ in range(3000):
        op = rng.choices(["add", "step", "abort", "pop"], [4, 6, 1, 1])[0]
        counts[op] += 1
        if op == "add":
            rid = engine.add_request(rng.choice(prompts), rng.choice(params))
            known[rid] = engine.requests[rid]
        elif op == "step":
            engine.step()
            assert engine.kv.num_free + len(engine.kv.row_of) == 3
            assert len(engine.scheduler.running) <= 3
        elif op == "abort" and known:
            live = sorted(r for r, s in known.items() if not s.is_finished)
            rid = rng.choice(live if live and rng.random() < 0.7 else sorted(known))
            if rid in popped:
                with pytest.raises(KeyError, match=rid):
                    engine.abort(rid)
            else:
                before = engine.kv.num_free
                seq = known[rid]
                was_running = seq in engine.scheduler.running and not seq.is_finished
                engine.abort(rid)
                assert seq.is_finished
                if was_running and policy == "continuous":
                    assert engine.kv.num_free == before + 1
        elif op == "pop" and known:
            rid = rng.choice(sorted(known))
            if known[rid].is_finished and rid not in popped:
                popped[rid] = engine.pop(rid)
    while engine.has_unfinished():
        engine.step()
    assert_drained(engine)
    assert min(counts.values()) > 100
    reasons = {}
    for rid, seq in known.items():
        assert seq.is_finished
        want = solo(seq.prompt_ids, seq.params)
        if seq.finish_reason == "abort":
            assert seq.output_ids == want[:len(seq.output_ids)]  # a prefix of its output
        else:
            assert seq.output_ids == want, rid
        reasons[seq.finish_reason] = reasons.get(seq.finish_reason, 0) + 1
        if rid not in popped:
            engine.pop(rid)
    assert engine.requests == {}
    assert min(reasons.get(r, 0) for r in ("stop", "length", "abort")) > 5, reasons


# --- 6. Sequence ----------------------------------------------------------------------------

def test_sequence_finish_reasons(model):
    config = model.config
    seq = Sequence.create(config, [1, 5], greedy(5))
    assert seq.append(9) == "" and not seq.is_finished
    seq.append(EOS)
    assert (seq.finish_reason, seq.output_ids) == ("stop", [9, EOS])  # EOS kept
    seq = Sequence.create(config, [1, 5], greedy(3, ignore_eos=True))
    for t in (EOS, 4, EOS):
        seq.append(t)
    assert (seq.finish_reason, seq.output_ids) == ("length", [EOS, 4, EOS])
    seq = Sequence.create(config, [1], greedy(9, stop_token_ids=[7, 8], ignore_eos=True))
    for t in (EOS, 5, 8):
        seq.append(t)
    assert (seq.finish_reason, seq.output_ids, seq.num_tokens) == ("stop", [EOS, 5, 8], 4)
    with pytest.raises(RuntimeError, match="finished"):
        seq.append(3)
    assert seq.output_ids == [EOS, 5, 8]
    with pytest.raises(ValueError, match="reason"):
        Sequence.create(config, [1]).finish("done")
    with pytest.raises(ValueError, match="stop=.*tokenizer"):
        Sequence.create(config, [1], greedy(3, stop=["a"]))


def test_sequence_stop_string_across_tokens(shakespeare):
    model, tok = shakespeare
    ids = tok.encode("To be, or not to be, that is the question", add_special_tokens=False)
    pieces = [tok.decode([t]) for t in ids]
    # the stop string is the end of token j and the start of token j + 1: neither alone
    j = next(j for j in range(2, len(ids) - 1) if pieces[j] and pieces[j + 1]
             and pieces[j][-1] + pieces[j + 1][0] not in "".join(pieces[:j + 1]))
    stop = pieces[j][-1] + pieces[j + 1][0]
    seq = Sequence.create(model, [1], greedy(50, stop=[stop]), tok)
    deltas = []
    for t in ids:
        deltas.append(seq.append(t))
        if seq.is_finished:
            break
    assert seq.finish_reason == "stop" and seq.output_ids == ids[:j + 2]
    assert seq.stop_reason == stop  # the text ends before the stop string:
    full = tok.decode(ids[:j + 2])
    assert "".join(deltas) == seq.text == full[:full.index(stop)]


def test_sequence_text_deltas_and_times(shakespeare):
    model, tok = shakespeare
    eos = model.config.eos_token_ids[0]
    ids = tok.encode("Zwölf Boxkämpfer — naïve café 日本", add_special_tokens=False)
    ids = ids[:3] + [eos] + ids[3:]  # a special token in the middle: no text
    seq = Sequence.create(model, [1, 2], greedy(len(ids), ignore_eos=True), tok,
                          arrival_time=100.0)
    deltas = [seq.append(t, now=101.0 + i) for i, t in enumerate(ids)]
    assert "".join(deltas) == seq.text == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(deltas)  # no half characters on the way
    assert seq.finish_reason == "length"
    assert seq.arrival_time == 100.0 and seq.first_token_time == 101.0
    assert seq.finish_time == seq.token_times[-1] == 100.0 + len(ids)
    assert seq.ttft == 1.0
    live = Sequence.create(model, [1], greedy(2), tok)  # real clocks
    live.append(5)
    live.append(6)
    assert live.arrival_time <= live.first_token_time <= live.token_times[-1]
    assert live.token_times[-1] <= live.finish_time


# --- 7. the LLM front door ------------------------------------------------------------------

def test_llm_generate_order_params_metrics(shakespeare):
    model, tok = shakespeare
    llm = LLM(SHAKESPEARE, max_num_seqs=3, device="cpu")
    assert llm.engine.tokenizer is not None
    solo = Solo(model, tok)
    prompts = ["ROMEO:", "KING HENRY:\nNow", "First", "O", "JULIET:\nAy me"]
    lengths = [12, 3, 9, 1, 6]  # they finish out of order
    per_prompt = [greedy(n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, per_prompt, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in prompts]
    for request, prompt, p in zip(outs, prompts, per_prompt):
        want = solo(tok.encode(prompt), p)
        assert request.prompt == prompt and request.finished
        o = request.outputs[0]  # n=1: one answer
        assert o.index == 0 and len(request.outputs) == 1
        assert o.token_ids == want and len(want) == p.max_tokens
        assert o.text == tok.decode(want, skip_special_tokens=True)
        assert o.finish_reason == "length" and o.stop_reason is None
        m = request.metrics
        assert m["output_tokens"] == len(want) and m["prompt_tokens"] == len(request.prompt_token_ids)
        assert 0 < m["ttft"] <= m["e2e"]
        assert m["first_token"] - m["arrival"] == pytest.approx(m["ttft"])
        assert m["finish"] - m["arrival"] == pytest.approx(m["e2e"])
        if len(want) > 1:
            assert m["tpot"] > 0
            assert m["ttft"] + m["tpot"] * (len(want) - 1) == pytest.approx(m["e2e"])
        else:
            assert m["tpot"] is None
    one = llm.generate(prompts[:2], greedy(4), use_tqdm=False)  # one params for all
    one = [o.outputs[0] for o in one]
    assert [o.token_ids for o in one] == [solo(tok.encode(p), greedy(4)) for p in prompts[:2]]
    single = llm.generate("ROMEO:", greedy(4), use_tqdm=False)  # one prompt, text
    assert single[0].outputs[0].token_ids == one[0].token_ids
    single_ids = llm.generate(tok.encode("ROMEO:"), greedy(4), use_tqdm=False)  # ids
    assert single_ids[0].outputs[0].token_ids == one[0].token_ids
    assert single_ids[0].prompt is None  # token ids, no text
    with pytest.raises(ValueError, match="3 params for 2 prompts"):
        llm.generate(prompts[:2], per_prompt[:3], use_tqdm=False)
    assert_drained(llm.engine)


def test_llm_stream(shakespeare):
    model, tok = shakespeare
    llm = LLM(model, tok, max_num_seqs=2)
    params = greedy(20)
    text = llm.generate(["ROMEO:\n"], params, use_tqdm=False)[0].outputs[0].text
    pieces = list(llm.stream("ROMEO:\n", params))
    assert len(pieces) > 1 and all(pieces)
    assert "".join(pieces) == text
    assert_drained(llm.engine)
    it = llm.stream("JULIET:\n", greedy(30))
    first = next(it)
    assert first and llm.engine.kv.num_free == 1
    it.close()  # the caller stops early: the row comes back, the request is gone
    assert llm.engine.requests == {}
    assert_drained(llm.engine)
    assert "".join(llm.stream("ROMEO:\n", params)) == text  # the engine still serves
