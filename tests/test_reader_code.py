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
# Chapter 2: causal_attention. The right answer, and one that forgets the 1/sqrt(d).
ATTENTION = '''calls = []


def my_causal_attention(q, k, v):
    calls.append(tuple(q.shape))
    n, T = q.shape[1] // k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
    scores = q @ k.transpose(-2, -1) / {scale}
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
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
# Chapter 12: attend_by_pages. The right answer, and one that cuts the keys into four
# pieces (their bounds move with the length, and the bits with them).
PAGES = '''calls = []


def my_attend_by_pages(q, k, v, positions, page=16):
    calls.append(tuple(q.shape))
    *lead, S, d = k.shape
    page = {page}
    P = S // page
    kp, vp = (t.reshape(*lead, P, page, d) for t in (k, v))
    scores = q.unsqueeze(-3) @ kp.transpose(-1, -2) / math.sqrt(d)
    keys = torch.arange(S).view(P, 1, page)
    scores = scores.masked_fill(keys > positions[..., None, :, None], -math.inf)
    w = torch.exp(scores - scores.amax((-3, -1), keepdim=True))
    total = w.sum(-1).transpose(-1, -2).cumsum(-1)
    acc = (w @ vp).movedim(-3, -1).cumsum(-1)
    last = (positions // page).expand(q.shape[:-1])
    o = acc.gather(-1, last[..., None, None].expand(*last.shape, d, 1))[..., 0]
    return o / total.gather(-1, last[..., None])
'''
# Chapter 13: mlp_slice. The right answer, and one that cuts down_proj by its outputs.
MLP_SLICE = '''calls = []


def my_mlp_slice(name, config, world, rank):
    calls.append(name)
    n, extra = divmod(config.intermediate_size, world)
    start = rank * n + min(rank, extra)
    return (1 if "{cut}" in name else 0), range(start, start + n + (rank < extra))
'''
LOAD_13 = """print(shard_slice("layers.0.mlp.down_proj.weight", SMOL, 2, 1))
"""
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
# Chapter 7: fill. The right answer, and one whose padding rows write to slot 0.
FILL = '''calls = []


def my_fill(self, ids, meta, new_ids, new_meta):
    calls.append(0 if new_ids is None else len(new_ids))
    B = 0 if new_ids is None else len(new_ids)
    meta.slot_mapping[B:] = {pad}
    meta.positions[B:] = 0
    meta.block_tables[B:] = 0
    ids[B:] = 0
    if B:
        ids[:B] = new_ids
        meta.positions[:B] = new_meta.positions
        meta.slot_mapping[:B] = new_meta.slot_mapping
        w = new_meta.block_tables.shape[1]
        meta.block_tables[:B, :w] = new_meta.block_tables
        meta.block_tables[:B, w:] = 0
    meta.cache.clear()
'''
# Chapter 9: hand_out. The right answer, and one that never forgets a finished request.
HAND_OUT = '''calls = []


def my_hand_out(outputs, streams, engine):
    calls.append(len(outputs))
    handed = []
    for out in outputs:
        stream = streams.get(out.request_id)
        if stream is None:
            continue
        handed.append((stream, out))
        if out.finished and {forget}:
            del streams[out.request_id]
            engine.pop(out.request_id)
    return handed
'''
# Chapter 10: rejection_sample. The right answer, and one that replaces a rejected draft
# from p instead of from what p has more of than q.
REJECTION = '''calls = []


def my_rejection_sample(p, q, draft, generator=None):
    calls.append(len(draft))
    out = []
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else q[i, x]
        if torch.rand((), generator=generator) * q_x < p[i, x]:
            out.append(x)
            continue
        q_i = one_hot(x, p.shape[-1], p) if q is None else q[i]
        return out + [draw({rest}, generator)]
    return out + [draw(p[len(draft)], generator)]
'''
ENGINE_10 = """engine_before = len(calls)
LLM(str(bundled_model_path()), speculative_config={"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}).generate(
    [[5, 9, 2, 7] * 4], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
print(f"the engine called it {len(calls) - engine_before} times")
"""
# name: (notebook, stub cell, run_on cell, last cell, right, wrong, cells skipped
# because nothing up to the last cell needs them, more checks after the last cell)
CHAPTERS = {
    # c038 encodes tricky texts and compares the ids with Hugging Face's tokenizer
    "bpe": ("01_tokenizer.ipynb", "c023y-ex-stub", "c025-run-on", "c038",
            BPE.format(pick="min"), BPE.format(pick="max"), (), ""),
    # c031 compares the model's logits with transformers' (c029 measures loading's memory
    # in other processes: nothing after it needs it)
    "causal_attention": ("02_naive_loop.ipynb", "c019f-ex-stub", "c019j-run-on", "c031",
                         ATTENTION.format(scale="q.shape[-1] ** 0.5"),
                         ATTENTION.format(scale="1"), ("c029", "c029b"), ""),
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
    # c51 compares an engine's tokens with graphs (the static buffers) and without;
    # §1 and §2's measurements (c13 to c24) are not needed for it
    "fill": ("07_performance.ipynb", "c42d-ex-stub", "c43a-run-on", "c51-check",
             FILL.format(pad="self.kv.pad_slot"), FILL.format(pad="0"),
             ("c13-floors", "c16-floors", "c17-floors", "c18-floors", "c19b-floors",
              "c22-mbu", "c24-mbu"), ""),
    # c38 runs three requests through the engine thread, against LLM.generate's text
    "hand_out": ("09_serving.ipynb", "c35b-ex-stub", "c35f-run-on", "c38-demo",
                 HAND_OUT.format(forget="True"), HAND_OUT.format(forget="False"), (), ""),
    # c34 measures the first token's distribution; then an engine that speculates
    "rejection_sample": ("10_speculative.ipynb", "c31b-ex-stub", "c31e-run-on",
                         "c34-check", REJECTION.format(rest="(p[i] - q_i).clamp(min=0)"),
                         REJECTION.format(rest="p[i]"), (), ENGINE_10),
    # s46 fills a bitmask of the real vocabulary through FSMGrammar
    "allowed_tokens": ("11_structured_output.ipynb", "s41c-ex-stub", "s41g-run-on",
                       "s46-matcher-demo", ALLOWED.format(walk="dfa.walk(after, rest) >= 0"),
                       ALLOWED.format(walk="True"), (), ""),
    # b37 puts a row at every place of a batch; then the engine's invariant mode
    "fixed_rows": ("12_batch_invariance.ipynb", "b32-ex-stub", "b36b-run-on",
                   "b37-every-place", FIXED_ROWS.format(pad="-n % rows"),
                   FIXED_ROWS.format(pad="0"), ("b12-run",), ENGINE_12),
    # b44 checks fixed_order_attention (against SDPA, padded, in chunks, as a decode
    # step); then the engine's invariant mode
    "attend_by_pages": ("12_batch_invariance.ipynb", "b41c-ex-stub", "b42b-run-on",
                        "b44-attn-check", PAGES.format(page="page"),
                        PAGES.format(page="S // 4"), ("b12-run",), ENGINE_12),
    # t36 defines shard_slice, which load_shard asks for every tensor's cut (rank 0 of
    # every engine of the chapter loads in this process)
    "mlp_slice": ("13_tensor_parallel.ipynb", "t21-ex-stub", "t25c-run-on", "t36-slices",
                  MLP_SLICE.format(cut="down_proj"), MLP_SLICE.format(cut="no such"), (),
                  LOAD_13),
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
