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

from minillm.tokenizer import (BYTE_TO_CHAR, LLAMA3_PATTERN, QWEN2_PATTERN, IncrementalDecoder,
                               Tokenizer, TokenizerFileError, learn_merges, merge_pair)
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
    byte_ids = [bundled.vocab[BYTE_TO_CHAR[b]] for b in "界".encode()]
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
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(Path(__file__).parent)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(Path(__file__).parent / "no-such-folder")
    for bad in (4, True, [1, 2], 3.5):
        with pytest.raises(TypeError, match=type(bad).__name__):
            bundled.encode(bad)
        with pytest.raises(ValueError, match=type(bad).__name__):   # both, as the book wants
            bundled.encode(bad)
    with pytest.raises(ValueError, match=r"True.*not an int"):
        bundled.decode([True])
    with pytest.raises(TypeError, match="int"):
        bundled.decode(5)


def test_save_to_a_file_path_is_refused(bundled, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        bundled.save(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"


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



# ---------------------------------------------------------------- BPE: heap against the rescan
def _rescan_bpe(tok: Tokenizer, ids: list[int]) -> list[int]:
    "The textbook encoder: rescan all pairs, merge the lowest rank everywhere, repeat."
    while len(ids) > 1:
        found = [tok._ranks[p] for p in zip(ids, ids[1:]) if p in tok._ranks]
        if not found:
            return ids
        rank, new = min(found)
        pair = next(p for p in zip(ids, ids[1:]) if tok._ranks.get(p) == (rank, new))
        ids = merge_pair(ids, pair, new)
    return ids


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="aeiou tnsrhl'", min_size=1, max_size=80))
def test_heap_bpe_equals_the_rescan(bundled, text):
    symbols = [bundled.vocab[BYTE_TO_CHAR[b]] for b in text.encode()]
    assert bundled._bpe(symbols) == _rescan_bpe(bundled, symbols)


def test_long_words_are_not_cached_and_still_right(bundled):
    rust = RustTokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    word = "thou" * 2000 + "ROMEO" * 500
    assert bundled.encode(word, add_special_tokens=False) == rust.encode(
        word, add_special_tokens=False).ids
    assert all(len(w) <= 256 for w in bundled._cache)


# ---------------------------------------------------------------- SentencePiece-style BPE
SP_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
BOS_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
             {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}


def _added(content: str, i: int, special: bool = True, **flags) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special, **flags}


def sentencepiece_spec(kind: str) -> dict:
    """A Llama-2-style tokenizer.json: <unk>, <s>, </s>, the 256 '<0x..>' byte tokens, then
    merges trained by `tokenizers` (few letters in the alphabet, so byte fallback is common)."""
    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    tk.train_from_iterator([_training_text()], trainers.BpeTrainer(
        vocab_size=600, limit_alphabet=60, show_progress=False))
    spec = json.loads(tk.to_str())
    trained = spec["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t in sorted(trained, key=trained.get):
        vocab.setdefault(t, len(vocab))
    spec["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    spec["added_tokens"] = [_added("<unk>", 0), _added("<s>", 1), _added("</s>", 2)]
    spec["post_processor"] = BOS_TEMPLATE
    spec["decoder"] = SP_DECODER
    if kind == "llama2":          # Llama 2, TinyLlama, Mistral 7B v0.1
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        spec["pre_tokenizer"] = None
    elif kind == "metaspace-first":   # what newer transformers versions write for Llama
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                                 "prepend_scheme": "first", "split": False}
    else:                          # the older Metaspace that splits, with its own decoder
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True}
        spec["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True}
    return spec


def _write(folder: Path, spec: dict, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["llama2", "metaspace-first", "metaspace-split"])
def sentencepiece(request, tmp_path_factory):
    spec = sentencepiece_spec(request.param)
    folder = _write(tmp_path_factory.mktemp(request.param), spec,
                    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return Tokenizer.from_pretrained(folder), RustTokenizer.from_str(json.dumps(spec))


SP_SUITE = SUITE + ["Hello", " leading space", "two  spaces", "\u2581already marked",
                    "a\u2581b \u2581", "<s>hello</s> x<s>", "x<s> y</s>", "<unk>"]


def test_sentencepiece_same_ids_and_text_as_tokenizers(sentencepiece):
    ours, rust = sentencepiece
    assert ours.vocab_size == rust.get_vocab_size() and not ours.byte_level
    _same(ours, rust, SP_SUITE)
    byte_ids = ours.encode("界", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in byte_ids][-3:] == ["<0xE7>", "<0x95>", "<0x8C>"]


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
       | st.text(" \t\n\u2581ab<s>/", max_size=30))
def test_sentencepiece_same_ids_on_random_text(sentencepiece, text):
    ours, rust = sentencepiece
    ids = ours.encode(text)
    assert ids == rust.encode(text).ids
    assert ours.decode(ids, skip_special_tokens=True) == rust.decode(ids)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 599), max_size=25))
def test_sentencepiece_decode_any_ids_like_tokenizers(sentencepiece, ids):
    """Any id sequence (broken byte runs included) decodes as `tokenizers` decodes it, and
    streaming gives the same text."""
    ours, rust = sentencepiece
    for skip in (True, False):
        text = ours.decode(ids, skip_special_tokens=skip)
        assert text == rust.decode(ids, skip_special_tokens=skip)
        dec = IncrementalDecoder(ours, skip_special_tokens=skip)
        assert "".join([dec.push(i) for i in ids] + [dec.flush()]) == text


# ---------------------------------------------------------------- other tokenizer.json features
def _byte_level_spec(tmp_path) -> dict:
    "A small byte-level file to change one feature at a time."
    return Tokenizer.train([_training_text()], 400, special_tokens=["<s>", "</s>"],
                           bos_token="<s>", eos_token="</s>", pad_token=None,
                           progress=False).to_hf_json()


def _both(spec: dict, tmp_path) -> tuple[Tokenizer, RustTokenizer]:
    return (Tokenizer.from_pretrained(_write(tmp_path / "tok", spec)),
            RustTokenizer.from_str(json.dumps(spec)))


def _same(ours, rust, texts) -> None:
    "Same ids as `tokenizers` with and without specials, and the same decoded text."
    for text in texts:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == rust.encode(text, add_special_tokens=add).ids, (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == rust.decode(
                    ids, skip_special_tokens=skip), (text, skip)


FEATURE_TEXTS = SUITE + ["<tool>x</s>", "a <tool> b<s>", "one<s>two", " x", "1a2 b"]


def test_roberta_post_processor(tmp_path):
    spec = _byte_level_spec(tmp_path)
    spec["post_processor"] = {"type": "RobertaProcessing", "sep": ["</s>", 400 - 1],
                              "cls": ["<s>", 400 - 2], "trim_offsets": True,
                              "add_prefix_space": False}
    ours, rust = _both(spec, tmp_path)
    assert ours.encode("hi")[0] == 398 and ours.encode("hi")[-1] == 399
    _same(ours, rust, FEATURE_TEXTS)


def test_non_special_added_tokens_are_kept_by_skip_special_tokens(tmp_path):
    spec = _byte_level_spec(tmp_path)
    spec["added_tokens"].append(_added("<tool>", 400, special=False))
    ours, rust = _both(spec, tmp_path)
    ids = ours.encode("a <tool> b", add_special_tokens=False)
    assert 400 in ids and ours.decode(ids + [399], skip_special_tokens=True) == "a <tool> b"
    assert 400 in ours.encode("a <tool> b", parse_special=False)    # not special: still parsed
    _same(ours, rust, FEATURE_TEXTS)
    dec = IncrementalDecoder(ours, skip_special_tokens=True)
    assert "".join([dec.push(i) for i in ids] + [dec.flush()]) == "a <tool> b"


def test_normalized_added_tokens_and_byte_level_prefix_space(tmp_path):
    spec = _byte_level_spec(tmp_path)
    spec["added_tokens"].append(_added("<tool>", 400, special=False, normalized=True))
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "Replace", "pattern": {"String": "1"}, "content": "one"}]}
    spec["pre_tokenizer"]["pretokenizers"][-1]["add_prefix_space"] = True
    ours, rust = _both(spec, tmp_path)
    _same(ours, rust, FEATURE_TEXTS + ["<t1ol>", "e\u0301<tool>"])


def test_unknown_characters_without_byte_fallback(tmp_path):
    spec = sentencepiece_spec("llama2")
    for fuse in (True, False):
        spec["model"].update(byte_fallback=False, fuse_unk=fuse)
        ours, rust = _both(spec, tmp_path / str(fuse))
        _same(ours, rust, ["你好，世界 ok", "😀😀 x 😀"])
    del spec["model"]["unk_token"]
    ours, _ = _both(spec, tmp_path / "no-unk")
    with pytest.raises(ValueError, match="no token"):
        ours.encode("你好")


UNSUPPORTED = {
    "lstrip": lambda s: s["added_tokens"][0].update(lstrip=True),
    "rstrip": lambda s: s["added_tokens"][0].update(rstrip=True),
    "single_word": lambda s: s["added_tokens"][0].update(single_word=True),
    "end_of_word_suffix": lambda s: s["model"].update(end_of_word_suffix="</w>"),
    "continuing_subword_prefix": lambda s: s["model"].update(continuing_subword_prefix="##"),
    "dropout": lambda s: s["model"].update(dropout=0.1),
    "'WordPiece'": lambda s: s["model"].update(type="WordPiece"),
    "'Lowercase'": lambda s: s.update(normalizer={"type": "Lowercase"}),
    "Replace with pattern": lambda s: s.update(normalizer={
        "type": "Replace", "pattern": {"Regex": " +"}, "content": " "}),
    "'Digits'": lambda s: s.update(pre_tokenizer={"type": "Digits", "individual_digits": True}),
    "Split": lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"),
    "more than one step adds tokens": lambda s: s.update(
        post_processor={"type": "Sequence", "processors": [
            {"type": "RobertaProcessing", "sep": ["</s>", 399], "cls": ["<s>", 398]},
            s["post_processor"]]}),
    "'Bogus'": lambda s: s.update(post_processor={"type": "Bogus"}),
    "decoder steps": lambda s: s.update(decoder={"type": "WordPiece", "prefix": "##"}),
    "truncation": lambda s: s.update(truncation={"max_length": 4}),
    "do not match": lambda s: s.update(decoder=SP_DECODER),
}


@pytest.mark.parametrize("feature", list(UNSUPPORTED))
def test_unsupported_features_are_refused_by_name(tmp_path, feature):
    spec = _byte_level_spec(tmp_path)
    UNSUPPORTED[feature](spec)
    folder = _write(tmp_path / "tok", spec)
    with pytest.raises(TokenizerFileError, match=feature) as info:
        Tokenizer.from_pretrained(folder)
    assert str(folder / "tokenizer.json") in str(info.value)


BROKEN = {
    "not valid JSON": "",
    "not valid JSON:": "{\"model\": ",
    "holds list": [],
    "field 'model' is missing": {},
    "field 'model.vocab' is \\[\\]": lambda s: s["model"].update(vocab=[]),
    "model.merges\\[3\\]": lambda s: s["model"]["merges"].__setitem__(3, "a"),
    "merge #5 .*not in the vocabulary": lambda s: s["model"]["merges"].__setitem__(5, ["zz", "q"]),
    "not a valid regex": lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(
        pattern={"Regex": "(unclosed"}),
    "added_tokens\\[1\\].id": lambda s: s["added_tokens"][1].update(id="7"),
    "ids must be ints": lambda s: s["model"]["vocab"].update(x=-3),
    "field 'added_tokens' is": lambda s: s.update(added_tokens={"a": 1}),
    "field 'pre_tokenizer'": lambda s: s.update(pre_tokenizer="ByteLevel"),
}


@pytest.mark.parametrize("problem", list(BROKEN))
def test_broken_files_give_a_clear_error(tmp_path, problem):
    change = BROKEN[problem]
    folder = tmp_path / "tok"
    folder.mkdir()
    if callable(change):
        spec = _byte_level_spec(tmp_path)
        change(spec)
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    else:
        (folder / "tokenizer.json").write_text(
            change if isinstance(change, str) else json.dumps(change))
    with pytest.raises(TokenizerFileError, match=problem) as info:
        Tokenizer.from_pretrained(folder)
    assert "tokenizer.json" in str(info.value)


def test_broken_tokenizer_config_is_named(tmp_path):
    folder = _write(tmp_path / "tok", _byte_level_spec(tmp_path))
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerFileError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_pretrained(folder)


def test_save_and_load_keeps_a_sentencepiece_tokenizer(sentencepiece, tmp_path):
    ours, rust = sentencepiece
    again = Tokenizer.from_pretrained(ours.save(tmp_path / "again"))
    reloaded_rust = RustTokenizer.from_file(str(tmp_path / "again" / "tokenizer.json"))
    for text in SP_SUITE:
        assert again.encode(text) == ours.encode(text) == reloaded_rust.encode(text).ids


@pytest.mark.parametrize("kind, config", [
    ("metaspace-first", {"tokenizer_class": "LlamaTokenizerFast"}),
    ("metaspace-first", {"tokenizer_class": "LlamaTokenizer", "legacy": False}),
    ("llama2", {"tokenizer_class": "PreTrainedTokenizerFast"}), ("llama2", {}),
    ("metaspace-split", {})])
def test_sentencepiece_same_ids_as_transformers(tmp_path, kind, config):
    """transformers rebuilds the text steps of Llama's tokenizer class (from `legacy` and
    `add_prefix_space`); where they are the file's own steps, and for the other classes
    (the file as it is), we give its ids."""
    folder = _write(tmp_path / kind, sentencepiece_spec(kind),
                    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **config})
    ours, hf = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    for text in SP_SUITE + ["  lead", "<s> x"]:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf(text, add_special_tokens=add)["input_ids"], (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("config", [
    {"tokenizer_class": "LlamaTokenizerFast"}, {"tokenizer_class": "LlamaTokenizer", "legacy": True},
    {"tokenizer_class": "LlamaTokenizer", "legacy": False},
    {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}])
def test_llama_class_that_replaces_the_files_steps_is_refused(tmp_path, config):
    """For Llama 2's own file, the steps transformers builds are not the file's: transformers
    and `tokenizers` give different ids for the same folder, so there is nothing to match."""
    folder = _write(tmp_path / "llama2", sentencepiece_spec("llama2"),
                    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **config})
    hf, rust = AutoTokenizer.from_pretrained(folder), RustTokenizer.from_file(str(folder / "tokenizer.json"))
    assert any(hf(t)["input_ids"] != rust.encode(t).ids for t in ["  lead", "<s> x", "<s>x"])
    with pytest.raises(TokenizerFileError, match="tokenizer_class 'LlamaTokenizer'.*normalizer"):
        Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("tokenizer_class", ["Qwen2TokenizerFast", "GPT2Tokenizer",
                                             "PreTrainedTokenizerFast"])
def test_tokenizer_class_steps_as_transformers_builds_them(hf_trained, tmp_path,
                                                          tokenizer_class):
    """transformers builds the steps of Qwen2Tokenizer and GPT2Tokenizer itself, whatever
    the file says (here: files of another style); we follow it."""
    kind, ours, _ = hf_trained
    folder = ours.save(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = tokenizer_class
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    again, hf = Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    for text in SUITE + specials_suite("<s>", "</s>"):
        ids = again.encode(text)
        assert ids == hf(text)["input_ids"], (kind, text)
        assert again.decode(ids) == hf.decode(ids)


def test_unknown_tokenizer_class_is_refused(tmp_path, bundled):
    folder = bundled.save(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**config, "tokenizer_class": "GemmaTokenizerFast"}))
    with pytest.raises(TokenizerFileError, match="GemmaTokenizer"):
        Tokenizer.from_pretrained(folder)
