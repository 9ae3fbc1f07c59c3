"""minillm.tokenizer: byte-level BPE, the same ids as Hugging Face, streaming-safe decoding."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer

from minillm.tokenizer import (LLAMA3_PATTERN, QWEN2_PATTERN, IncrementalDecoder, Tokenizer,
                               learn_merges, merge_pair)
from minillm.utils import bundled_model_path

SUITE = [
    "",
    "Hello, world! This is a short test of the tokenizer, isn't it?",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    "def square(x: int) -> int:\n\treturn x ** 2  # comment\n\nclass A:\n    pass\n\nprint({'a': [1, 2]})\n",
    "你好，世界",
    "😀🎉👍🏽 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🇫🇷 \U0001F9D1\u200d\U0001F4BB",
    " \t  \n\n\n   \t\r\n  x  \n",
    "   leading and trailing spaces   ",
    "0 12 345 6789 3.14159 1,000,000 year 2024",
    "They're here; I'm sure we'll see what you'd've DONE. 'Tis true.",
    "café naïve Ünïcödé e\u0301 ﬁ Ω",
    "x\x00y\x1fz\x7f",
]


def specials_suite(bos: str, eos: str) -> list[str]:
    "Texts with the tokenizer's own special tokens written inside them."
    return [f"{bos}hello{eos}", f"one {eos} two{bos}{bos}three", f"{eos}\n\n{bos} x", f"<{bos}>"]


# ---------------------------------------------------------------- the bundled tokenizer
@pytest.fixture(scope="module")
def bundled() -> Tokenizer:
    return Tokenizer.from_pretrained(bundled_model_path())


@pytest.fixture(scope="module")
def bundled_hf():
    return AutoTokenizer.from_pretrained(bundled_model_path())


def test_bundled_properties(bundled):
    assert bundled.vocab_size == 4096
    assert [bundled.bos_token_id, bundled.eos_token_id, bundled.pad_token_id] == [
        bundled.special_token_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")]
    assert len({bundled.bos_token_id, bundled.eos_token_id, bundled.pad_token_id}) == 3
    assert bundled.encode("ROMEO:")[0] == bundled.bos_token_id


def test_bundled_same_ids_as_transformers(bundled, bundled_hf):
    for text in SUITE + specials_suite("<|bos|>", "<|eos|>"):
        for add in (True, False):
            ours = bundled.encode(text, add_special_tokens=add)
            assert ours == bundled_hf(text, add_special_tokens=add)["input_ids"], (text, add)
        assert bundled.decode(ours) == bundled_hf.decode(ours)
        assert bundled.decode(ours, skip_special_tokens=True) == bundled_hf.decode(ours, skip_special_tokens=True)
    assert bundled_hf.bos_token_id == bundled.bos_token_id
    assert bundled_hf.eos_token_id == bundled.eos_token_id
    assert bundled_hf.pad_token_id == bundled.pad_token_id


def test_bundled_json_loads_in_rust_tokenizers(bundled):
    rust = RustTokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    text = SUITE[2] + SUITE[3] + SUITE[4]
    assert rust.encode(text).ids == bundled.encode(text)


def test_roundtrip_suite(bundled):
    for text in SUITE:
        assert bundled.decode(bundled.encode(text)) == "<|bos|>" + text
        assert bundled.decode(bundled.encode(text), skip_special_tokens=True) == text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_roundtrip_any_unicode(bundled, text):
    assert bundled.decode(bundled.encode(text, add_special_tokens=False)) == text


_rust_cache: dict = {}


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.text(" \t\n\r\x0b\x0c\x1c\x85\xa0\u2028\u3000ab1'", max_size=20))
def test_same_ids_as_rust_on_random_text(bundled, text):
    rust = _rust_cache.get("r") or _rust_cache.setdefault(
        "r", RustTokenizer.from_file(str(bundled_model_path() / "tokenizer.json")))
    assert bundled.encode(text, add_special_tokens=False) == rust.encode(text, add_special_tokens=False).ids


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_incremental_decoder_deltas(bundled, text):
    ids = bundled.encode(text)
    dec = IncrementalDecoder(bundled)
    deltas = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == bundled.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_decoder_waits_for_a_split_character(bundled):
    # '界' is three bytes; as single byte tokens it arrives in three pieces
    byte_ids = [bundled._byte_ids[b] for b in "界".encode()]
    assert bundled.decode(byte_ids[:1]) == "\ufffd"                      # the naive way breaks
    dec = IncrementalDecoder(bundled)
    assert [dec.push(i) for i in byte_ids] == ["", "", "界"]
    assert dec.flush() == ""
    dec = IncrementalDecoder(bundled)
    assert dec.push(byte_ids[0]) == "" and dec.flush() == "\ufffd"      # cut off: replaced at the end only


def test_incremental_decoder_skips_specials(bundled):
    ids = bundled.encode("hi") + [bundled.eos_token_id]
    dec = IncrementalDecoder(bundled, skip_special_tokens=True)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "hi"


# ---------------------------------------------------------------- bad input
def test_bad_input(bundled):
    with pytest.raises(TypeError, match="bytes"):
        bundled.encode(b"hello")
    with pytest.raises(TypeError, match="NoneType"):
        bundled.encode(None)
    with pytest.raises(ValueError, match=r"4096.*\[0, 4096\)"):
        bundled.decode([5, 4096])
    with pytest.raises(ValueError, match=r"-1.*\[0, 4096\)"):
        bundled.decode([-1])
    with pytest.raises(ValueError, match=r"2\.5.*not an int"):
        bundled.decode([1, 2.5])
    with pytest.raises(ValueError, match="'x'"):
        bundled.decode(["x"])
    with pytest.raises(ValueError, match="<\\|nope\\|>"):
        bundled.special_token_id("<|nope|>")
    with pytest.raises(ValueError, match="4096"):
        IncrementalDecoder(bundled).push(4096)
    with pytest.raises(ValueError, match="<\\|start\\|>"):
        Tokenizer.train(["abc"], 300, special_tokens=["<|bos|>"], bos_token="<|start|>", eos_token=None,
                        pad_token=None, progress=False)
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(["abc"], 100, progress=False)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(Path(__file__).parent)


def test_decode_accepts_tensors_and_numpy(bundled):
    import numpy as np
    import torch
    ids = bundled.encode("To be, or not to be")
    assert bundled.decode(torch.tensor(ids)) == bundled.decode(np.array(ids)) == bundled.decode(ids)


# ---------------------------------------------------------------- training
def test_merge_pair():
    assert merge_pair([1, 1, 1, 2, 1, 1], (1, 1), 9) == [9, 1, 2, 9]


def test_learn_merges_matches_a_naive_trainer():
    words = {b"low": 5, b"lower": 2, b"newest": 6, b"widest": 3, b"aaaa": 4}
    fast = learn_merges(words, 12, progress=False)
    # the textbook loop: recount every pair after every merge
    seqs, naive = {w: list(w) for w in words}, []
    for new_id in range(256, 268):
        counts: dict = {}
        for w, s in seqs.items():
            for p in zip(s, s[1:]):
                counts[p] = counts.get(p, 0) + words[w]
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        naive.append(best)
        seqs = {w: merge_pair(s, best, new_id) for w, s in seqs.items()}
    assert fast == naive


def test_train_save_load_roundtrip(tmp_path):
    text = "the cat sat on the mat. the cat ate the rat. " * 20
    tok = Tokenizer.train([text], 270, progress=False)
    assert tok.vocab_size == 270 and len(tok.merges) == 270 - 256 - 3
    assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()) / 2
    tok.save(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.encode(text) == tok.encode(text)
    assert again.bos_token_id == tok.bos_token_id == 267
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf(text)["input_ids"] == tok.encode(text)


# ---------------------------------------------------------------- tokenizers trained by Hugging Face
def _training_text() -> str:
    "Different text from the bundled tokenizer's: Python source, English, Chinese, emoji."
    import inspect
    import json as json_module
    src = inspect.getsource(textwrap) + inspect.getsource(json_module.decoder)
    prose = ("It was a bright cold day in April, and the clocks were striking thirteen. " * 3
             + "在一个晴朗的日子里，我们去公园散步。你好，世界！这是一个测试。" * 3 + "😀 🎉 👍🏽 ✨ " * 5)
    return src + prose


@pytest.fixture(scope="module", params=["llama3", "qwen2-string-merges", "gpt2"])
def hf_trained(request, tmp_path_factory):
    """A byte-level BPE trained by the `tokenizers` library, saved, and loaded back both ways."""
    kind = request.param
    tk = RustTokenizer(models.BPE())
    if kind == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    else:
        pattern = LLAMA3_PATTERN if kind == "llama3" else QWEN2_PATTERN
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if kind.startswith("qwen2"):
        tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([_training_text()], trainer)
    bos_id = tk.token_to_id("<s>")
    if kind == "llama3":
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", bos_id)])
    folder = tmp_path_factory.mktemp(kind)
    tk.save(str(folder / "tokenizer.json"))
    spec = json.loads((folder / "tokenizer.json").read_text())
    if kind == "llama3":
        spec["model"]["ignore_merges"] = True            # as in Llama 3's own file
    if kind == "qwen2-string-merges":
        spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]   # the older "a b" format
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return kind, Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def test_hf_trained_same_ids(hf_trained):
    kind, ours, hf = hf_trained
    assert ours.vocab_size == len(hf) == 700
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    for text in SUITE + specials_suite("<s>", "</s>"):
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf(text, add_special_tokens=add)["input_ids"], (kind, text, add)
        assert ours.decode(ids) == hf.decode(ids), (kind, text)
    if kind == "llama3":
        assert ours.encode("hi")[0] == ours.bos_token_id
    else:
        assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)

