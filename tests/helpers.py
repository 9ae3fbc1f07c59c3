"""What the unit tests share: tiny random Hugging Face models of every family minillm loads,
saved to a folder so that both `transformers` and `minillm.load_model` read the same weights,
and `transformers`' greedy generation as the reference loop; `greedy` parameters, `drive` to
run an engine through requests that arrive over steps, `forbid` to fail a test when a function
is called, and `compiling` to prove that torch.compile really compiled.

Test modules import these functions (`from helpers import make_hf_model`); the fixtures built
on them live in conftest.py."""
from __future__ import annotations

import contextlib
import copy
import socket
from pathlib import Path
from typing import NamedTuple

import torch
import transformers

from minillm.model.loader import load_model
from minillm.sampling import SamplingParams
from minillm.sequence import Sequence

torch.set_num_threads(1)

# Small enough to build in milliseconds, big enough to have GQA (4 query heads, 2 KV heads).
TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
SPECIAL = dict(bos_token_id=1, eos_token_id=2)

# family -> (transformers config class, what differs from TINY)
FAMILIES = {
    "llama_gqa_untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3_rope_scaling": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama_attention_bias": ("LlamaConfig", dict(attention_bias=True)),
    "mistral": ("MistralConfig", dict(sliding_window=64)),
    "qwen2_bias_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
}

WEIGHTS = ("init", "random_norms", "wide")


def make_hf_model(folder: Path, family: str = "llama_gqa_untied", weights: str = "random_norms",
                  save: dict | None = None, **overrides):
    """Build a random `transformers` model of `family`, save it to `folder`, return it (float32).

    weights: "init" keeps transformers' initialisation; "random_norms" also draws norm weights
    and biases at random, so a weight the loader forgets changes the logits; "wide" draws
    matrices with std 2/sqrt(fan_in), so that greedy decoding wanders over many tokens instead
    of repeating one. `save` goes to `save_pretrained` (e.g. `max_shard_size="100KB"`)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}; expected one of {WEIGHTS}")
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**TINY, **SPECIAL, **extra, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if weights == "wide" and p.dim() == 2:
                p.normal_(0, 2 / p.shape[1] ** 0.5)
            elif weights != "init" and name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif weights == "random_norms" and name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    hf.save_pretrained(folder, **(save or {}))
    return hf


def make_model_pair(folder: Path, family: str = "llama_gqa_untied", weights: str = "wide",
                    **overrides):
    """The same random weights twice: (transformers model, minillm model), both float32 on CPU."""
    hf = make_hf_model(folder, family, weights, **overrides)
    return hf, load_model(folder, device="cpu")


def hf_greedy(hf, prompt: list[int], n: int, **generate_kwargs) -> list[int]:
    """`transformers`' own greedy `generate()`: the new ids only."""
    config = copy.deepcopy(hf.generation_config)
    config.max_new_tokens, config.do_sample = n, False
    for key, value in generate_kwargs.items():
        setattr(config, key, value)
    if config.pad_token_id is None:
        config.pad_token_id = 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def greedy(n: int, **kw) -> SamplingParams:
    """Greedy decoding of at most `n` new tokens; `kw` are more SamplingParams fields."""
    return SamplingParams(temperature=0, max_tokens=n, **kw)


class Served(NamedTuple):
    """One request that `drive` ran: what it asked, what it streamed, how it ended."""
    prompt: list[int] | str
    params: SamplingParams | None
    streamed: list[int]  # the new ids of its RequestOutputs' answer, in order
    seq: Sequence  # the finished request, popped from the engine


def drive(engine, arrivals, max_steps: int = 10_000) -> dict[str, Served]:
    """Run an LLMEngine through `arrivals`, (step index, prompt, params) tuples in any order:
    each request is added before that step (ties in the given order), and the engine steps
    until all have finished. Every output brings one new id, and `finished` exactly when it
    has a finish_reason. Fails past `max_steps` steps. Returns {request id: Served}, in the
    order the requests were added."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    added, streamed, i, step = {}, {}, 0, 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i][0] <= step:
            _, prompt, params = arrivals[i]
            rid = engine.add_request(prompt, params)
            added[rid], streamed[rid] = (prompt, params), []
            i += 1
        outputs = engine.step() if engine.has_unfinished() else []
        for out in outputs:
            assert len(out.outputs) == 1  # n=1: one answer per request
            answer = out.outputs[0]
            assert len(answer.token_ids) == 1
            assert out.finished == (answer.finish_reason is not None)
            streamed[out.request_id] += answer.token_ids
        step += 1
        assert step < max_steps
    return {rid: Served(*added[rid], streamed[rid], engine.pop(rid)) for rid in added}


def answer_text(tok, ids: list[int], params: SamplingParams) -> str:
    """The text that an answer of `ids` shows, vLLM's way: a stop string and what
    follows it, and the text of the stop id that ended it, are left out."""
    keep = params.include_stop_str_in_output
    if ids and ids[-1] in params.stop_token_ids and not keep:
        ids = ids[:-1]
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in params.stop if s in text]
    if hits:
        at, stop = min(hits)
        text = text[:at + len(stop) if keep else at]
    return text


def forbid(monkeypatch, owner, name: str, message: str) -> None:
    """Replace `owner.name` (for the test) by a function that fails the test if called."""
    def called(*args, **kwargs):
        raise AssertionError(message)
    monkeypatch.setattr(owner, name, called)


@contextlib.contextmanager
def compiling():
    """Fail unless torch.compile really compiles inside the block: Dynamo's caches are
    reset first (what ran before compiles again), its errors raise instead of falling back
    to eager in silence, and at least one frame must compile to a graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    frames, graphs = counters["frames"]["ok"], counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(suppress_errors=False):
        yield
    assert counters["frames"]["ok"] > frames, "torch.compile compiled no frame"
    assert counters["stats"]["unique_graphs"] > graphs, "torch.compile made no graph"


@contextlib.contextmanager
def serving(llm, name: str):
    """(url, llm) of a server of `llm` while the block runs; afterwards the engine
    must hold no request and every KV block must be free."""
    from minillm.serve.app import build_app
    from minillm.serve.cli import BackgroundServer
    with BackgroundServer(build_app(llm, name)) as server:
        yield server.url, llm
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    blocks = llm.engine.kv.blocks
    assert blocks.num_free == blocks.num_blocks


def post(url: str, path: str, body, headers=None, **kw):
    """POST a JSON body (or raw bytes) to a test server. json.dumps escapes a lone
    surrogate as JSON may, which httpx's json= cannot."""
    import httpx
    import json
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=data, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})},
                      **kw)


def kernel_fixture(module):
    """An autouse fixture for the tests of one of chapter 7's C++ kernels (`module`
    has kernel()): built or loaded when the file's first test runs, so collecting
    the tests builds nothing; from then on the operator's CPU kernel."""
    import pytest

    @pytest.fixture(autouse=True, scope="module")
    def kernel_loaded():
        module.kernel()
    return kernel_loaded


def refuse_other_hosts(monkeypatch) -> None:
    """Only this machine may be named: a lookup of any other host fails at once
    (a client library that phones home fails the test instead of waiting)."""
    lookup = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"the test refuses to reach {host!r}")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
