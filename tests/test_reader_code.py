"""Issue 72: a reader's answer to a chapter's core exercise runs the rest of the chapter.
Each test puts an answer into the exercise's stub cell, runs the chapter's code cells as
far as the checks that use the function (tests/run_cells.py, in a fresh process), and
checks both paths: a right answer passes the exercise's test and the chapter's own later
checks run on it (it is called there); a wrong one is told what the test expected and a
hint, and the chapter goes on with the book's function (run as far as the cell that says
so: the cells after it are the book's own, which nbval runs)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_chapter(notebook: str, until: str, edits: dict) -> str:
    """The chapter's output as far as cell `until`, with the edits; it must not raise."""
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "run_cells.py"),
                           str(ROOT / "chapters" / notebook), until, json.dumps(edits)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


COUNT_CALLS = "calls_before = len(calls)\n"
CALLED_LATER = ("assert len(calls) > calls_before, 'not called after the exercise'\n"
                "print(f'called {len(calls) - calls_before} times after the exercise')\n")

# Chapter 1: BPE on one word. The right answer, and one that merges the highest rank first.
BPE = '''calls = []


def my_bpe(ids, ranks):
    calls.append(len(ids))
    ids = list(ids)
    while True:
        found = [(ranks[p][0], i) for i, p in enumerate(zip(ids, ids[1:])) if p in ranks]
        if not found:
            return ids
        _, i = {pick}(found)
        ids[i:i + 2] = [ranks[ids[i], ids[i + 1]][1]]
'''
# Chapter 2: top-k and top-p. The right answer, and a top-p that drops the token whose
# probability crosses top_p.
TOP_K_TOP_P = '''calls = []


def my_top_k_top_p(logits, params):
    calls.append(len(params))
    out = logits.clone()
    for row, p in enumerate(params):
        if p.temperature == 0:
            continue
        order = torch.sort(out[row], descending=True, stable=True).indices
        if p.top_k > 0:
            out[row, order[p.top_k:]] = float("-inf")
        if p.top_p < 1:
            probs = out[row].softmax(-1)[order]
            out[row, order[probs.cumsum(0) - {before} >= p.top_p]] = float("-inf")
    return out
'''
# Chapter 3: store. The right answer, and one that forgets to move T before the heads.
STORE = '''calls = []


def my_store(cache, layer_idx, k, v, slot_mapping):
    calls.append(layer_idx)
    h, d = k.shape[1], k.shape[3]
    slots = slot_mapping.reshape(-1)
    cache.k[layer_idx].index_copy_(0, slots, k.{how}.reshape(-1, h, d))
    cache.v[layer_idx].index_copy_(0, slots, v.{how}.reshape(-1, h, d))
'''
# Chapter 12: fixed_rows. The right answer, and one that leaves the last block short.
FIXED_ROWS = '''calls = []


def my_fixed_rows(f, x, rows=16):
    calls.append(len(x))
    n = x.shape[0]
    x = torch.cat([x, x.new_zeros({pad}, x.shape[1])])
    return torch.cat([f(x[i:i + rows]) for i in range(0, len(x), rows)])[:n]
'''
ENGINE_12 = """engine_before = len(calls)
LLM(str(bundled_model_path()), batch_invariant=True).generate(
    [[5, 9, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
print(f"the engine called it {len(calls) - engine_before} times")
"""
# Chapter 4: _admit. The right answer, and one that never cuts a prompt to the budget.
ADMIT = '''calls = []


def my_admit(self, budget, num_new):
    calls.append(budget)
    admitted = []
    while budget > 0 and len(self.running) < self.max_num_seqs:
        seq = self.next_waiting(budget)
        if seq is None or not self.kv.can_allocate(seq):
            break
        self.waiting.remove(seq)
        seq.num_computed_tokens = self.kv.allocate(seq)
        seq.status = RUNNING
        n = {n}
        admitted.append(seq)
        num_new.append(n)
        self.running.append(seq)
        budget -= n
    return admitted
'''
# Chapter 5: absmax_quantize. The right answer, and one with 128 levels instead of 127.
ABSMAX = '''calls = []


def my_absmax_quantize(w, group_size=None):
    calls.append(tuple(w.shape))
    rows, inputs = w.shape
    groups = w.detach().float().reshape(rows, -1, group_size or inputs)
    scale = groups.abs().amax(-1, keepdim=True) / {levels}
    q = (groups / scale).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(rows, inputs), scale.squeeze(-1)
'''
# Chapter 6: release. The right answer, and one that gives the first block back first.
RELEASE = '''calls = []


def my_release(bm, table):
    calls.append(len(table))
    for block in {order}(table):
        bm.ref_count[block] -= 1
        if bm.ref_count[block] == 0:
            bm.free_blocks[block] = None
'''
# Chapter 8: repeated_share. The right answer, and one that cuts the n-grams every n.
REPEATED = '''calls = []


def my_repeated_share(ids, n=4):
    calls.append(len(ids))
    ids = list(ids)
    grams = [tuple(ids[i:i + n]) for i in range(0, len(ids) - n + 1{step})]
    return 1 - len(set(grams)) / len(grams)
'''
# Chapter 11: allowed_tokens. The right answer, and one that never walks a token's rest.
ALLOWED = '''calls = []


def my_allowed_tokens(dfa, state, groups):
    calls.append(state)
    allowed = []
    for first, tokens in groups.items():
        after = dfa.next[state][first]
        if after >= 0:
            allowed += [i for i, rest in tokens if {walk}]
    return allowed
'''
# Chapter 7: default_buckets. The right answer, and one that lists a power twice.
BUCKETS = '''calls = []


def my_default_buckets(largest, smallest=1, factor=2):
    calls.append(largest)
    out, size = [], smallest
    while size {below} largest:
        out.append(size)
        size *= factor
    return out + [largest]
'''
ENGINE_7 = """from minillm.engine import LLMEngine
from minillm.model.loader import load_model

engine_before = len(calls)
LLMEngine(load_model(bundled_model_path(), dtype=torch.float32), cuda_graphs=True)
print(f"the engine called it {len(calls) - engine_before} times")
"""
# Chapter 9: add_delta. The right answer, and one that keeps only the last logprobs.
ADD_DELTA = '''calls = []


def my_add_delta(answers, c):
    calls.append(c.index)
    a = answers[c.index]
    a.text += c.text
    a.token_ids += c.token_ids
    if c.logprobs is not None:
        a.logprobs = {logprobs}
    a.finish_reason, a.stop_reason = c.finish_reason, c.stop_reason
'''
# Chapter 10: ngram_lookup. The right answer, and one that takes the earliest match.
NGRAM = '''calls = []


def my_ngram_lookup(tokens, k, n_min, n_max):
    calls.append(len(tokens))
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for start in {starts}:
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
'''
ENGINE_10 = """engine_before = len(calls)
LLM(str(bundled_model_path()), speculative_config={"method": "ngram",
    "num_speculative_tokens": 3}).generate([[5, 9, 2, 7] * 4], use_tqdm=False)
print(f"the engine called it {len(calls) - engine_before} times")
"""
# name: (notebook, stub cell, run_on cell, last cell, right, wrong, cells skipped
# because nothing up to the last cell needs them, more checks after the last cell)
CHAPTERS = {
    # c038 encodes tricky texts and compares the ids with Hugging Face's tokenizer
    "bpe": ("01_tokenizer.ipynb", "c023y-ex-stub", "c025-run-on", "c038",
            BPE.format(pick="min"), BPE.format(pick="max"), (), ""),
    # c043 plots and checks top-k and top-p through filter_logits, c047 samples
    "top_k_top_p": ("02_naive_loop.ipynb", "c038b-ex-stub", "c038b-3-run-on", "c047",
                    TOP_K_TOP_P.format(before="probs"), TOP_K_TOP_P.format(before="0"),
                    (), ""),
    # c024 compares the cached logits with the naive loop's, c028 runs generate
    "store": ("03_kv_cache.ipynb", "c018-s1d-ex-stub", "c018-s1b2-run-on", "c028",
              STORE.format(how="transpose(1, 2)"), STORE.format(how="contiguous()"),
              (), ""),
    # c49 steps an LLMEngine and checks who runs in each step
    "admit": ("04_continuous_batching.ipynb", "c21f3-ex-stub", "c21h-run-on", "c49-steps",
              ADMIT.format(n="min(seq.num_tokens - seq.num_computed_tokens, budget)"),
              ADMIT.format(n="seq.num_tokens - seq.num_computed_tokens"), (), ""),
    # c22 compares Int8Linear (from_linear quantizes) with the float layer it stands for
    "absmax_quantize": ("05_int8.ipynb", "c10d-ex-stub", "c11c-run-on", "c22-check",
                        ABSMAX.format(levels=127), ABSMAX.format(levels=128), (), ""),
    # c23 and c31c allocate, free (release) and check the reference counts
    "release": ("06_paged_attention.ipynb", "c20-blocks-s1y", "c20-blocks-s1u-run-on",
                "c31c-prefix", RELEASE.format(order="reversed"),
                RELEASE.format(order="list"), (), ""),
    # c41b diagnoses a greedy loop by its repeated 4-grams
    "repeated_share": ("08_troubleshooting.ipynb", "c40y-ex-stub", "c41a2-run-on",
                       "c41b-repeat", REPEATED.format(step=""), REPEATED.format(step=", n"),
                       (), ""),
    # c41b prints the buckets; then an engine that records graphs sizes them with it
    "default_buckets": ("07_performance.ipynb", "c40y-ex-stub", "c41a-run-on",
                        "c41b-graphs", BUCKETS.format(below="<"),
                        BUCKETS.format(below="<="), (), ENGINE_7),
    # c75 asks the server for a chat answer, gathered piece by piece (not streamed)
    "add_delta": ("09_serving.ipynb", "s48b-ex-stub", "s48f-run-on", "c75-chat",
                  ADD_DELTA.format(logprobs="(a.logprobs or []) + list(c.logprobs)"),
                  ADD_DELTA.format(logprobs="list(c.logprobs)"), ("c62-cli",), ""),
    # c42 drafts from a sentence; then an engine that speculates with prompt lookup
    "ngram_lookup": ("10_speculative.ipynb", "c41c-ex-stub", "c41g-run-on",
                     "c42-ngram-demo",
                     NGRAM.format(starts="range(len(tokens) - n - 1, -1, -1)"),
                     NGRAM.format(starts="range(len(tokens) - n)"), (), ENGINE_10),
    # s46 fills a bitmask of the real vocabulary through FSMGrammar
    "allowed_tokens": ("11_structured_output.ipynb", "s41c-ex-stub", "s41g-run-on",
                       "s46-matcher-demo", ALLOWED.format(walk="dfa.walk(after, rest) >= 0"),
                       ALLOWED.format(walk="True"), (), ""),
    # b37 puts a row at every place of a batch; then the engine's invariant mode
    "fixed_rows": ("12_batch_invariance.ipynb", "b32-ex-stub", "b36b-run-on",
                   "b37-every-place", FIXED_ROWS.format(pad="-n % rows"),
                   FIXED_ROWS.format(pad="0"), ("b12-run",), ENGINE_12),
}


def edits(name: str, answer: str, after_last: str) -> dict:
    _, stub, run_on, last, _, _, skipped, more = CHAPTERS[name]
    out = {cell: {"replace": "pass\n"} for cell in skipped}
    return {**out, stub: {"replace": answer}, run_on: {"after": COUNT_CALLS},
            last: {"after": more + after_last}}


@pytest.mark.parametrize("name", CHAPTERS)
def test_a_right_answer_runs_the_rest_of_the_chapter(name):
    notebook, _, _, last, right, *_ = CHAPTERS[name]
    out = run_chapter(notebook, last, edits(name, right, CALLED_LATER))
    assert "yours passes" in out and "yours fails" not in out
    assert f"from here on, the chapter runs on your {name}" in out
    assert "times after the exercise" in out
    if "the engine called it" in out:
        assert "the engine called it 0 times" not in out


@pytest.mark.parametrize("name", CHAPTERS)
def test_a_wrong_answer_is_told_why_and_the_chapter_goes_on_with_the_books(name):
    notebook, stub, run_on, _, _, wrong, skipped, _ = CHAPTERS[name]
    out = run_chapter(notebook, run_on, {**{cell: {"replace": "pass\n"} for cell in skipped},
                                         stub: {"replace": wrong}})
    assert "yours fails: AssertionError:" in out and "hint:" in out
    assert "the chapter goes on with the book's" in out
    assert f"from here on, the chapter runs on the book's {name}" in out
