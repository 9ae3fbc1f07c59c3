"""SentencePiece-style tokenizer.json files (byte fallback, a Chinese-English vocabulary, the
Llama-2 normalizer or a Metaspace pre-tokenizer), saved with a tokenizer_config.json as Hugging
Face saves them: whatever `Tokenizer.from_pretrained` accepts gives the ids and the text of
`tokenizers` (and of `transformers`) on every text; the rest is refused by name, before any work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from minillm.tokenizer import Tokenizer, TokenizerFileError

MARK = "\u2581"
CORPUS = ("我们今天去公园散步。 We walk in the park today. 你好，世界！ Hello, world! "
          "北京 is the capital of 中国. 我爱学习 and I love to learn. 中文 English 混合 "
          "text 测试 the quick brown fox jumps over the lazy dog 天气很好 ") * 10
SP_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": MARK}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
NO_STRIP_DECODER = {"type": "Sequence", "decoders": SP_DECODER["decoders"][:3]}
LLAMA2_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": MARK},
    {"type": "Replace", "pattern": {"String": " "}, "content": MARK}]}


def metaspace(scheme: str, split: bool) -> dict:
    return {"type": "Metaspace", "replacement": MARK, "prepend_scheme": scheme, "split": split}


# style -> (normalizer, pre_tokenizer, decoder), as tokenizer.json files write them
STYLES = {
    "llama2": (LLAMA2_NORMALIZER, None, SP_DECODER),           # Llama 2, Chinese-LLaMA
    "first": (None, metaspace("first", False), SP_DECODER),    # newer Llama-style files
    "first-split": (None, metaspace("first", True), SP_DECODER),
    "always": (None, metaspace("always", False), SP_DECODER),
    "always-split": (None, metaspace("always", True), SP_DECODER),
    "never": (None, metaspace("never", False), NO_STRIP_DECODER),
    "old-metaspace": (None, {"type": "Metaspace", "replacement": MARK, "str_rep": MARK,
                             "add_prefix_space": True},
                      {"type": "Metaspace", "replacement": MARK, "add_prefix_space": True}),
}
TOKEN = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False,
         "single_word": False}
CONFIGS = {
    "PreTrainedTokenizerFast": {"tokenizer_class": "PreTrainedTokenizerFast"},
    "no class": {},
    "LlamaTokenizer": {"tokenizer_class": "LlamaTokenizer"},
    "legacy": {"tokenizer_class": "LlamaTokenizerFast", "legacy": True},
    "not legacy": {"tokenizer_class": "LlamaTokenizerFast", "legacy": False},
    "no prefix": {"tokenizer_class": "LlamaTokenizer", "legacy": False,
                  "add_prefix_space": False},
}
TEXTS = [
    "", " ", "  ", "   ", "\n", " \n ", "\t", "\thello", " hello", "  hello", "hello ",
    "hello  world ", "hello", "你好", " 你好", "  你好世界", "你好 世界", "你好世界 ",
    "我们 love 北京", "Hello, 世界! 我们 today.", "😀", " 😀 x", "𝔘𝔫𝔦 é ﬁ", "a\u3000b",
    "\r\n x", MARK, f" {MARK}x", f"a{MARK}{MARK} b", "<s> 你好", "<s>你好", "x</s>  y",
    "  <s>", "<unk>", "tab\tand\nnewline\n\n 中文", "the quick brown fox 天气很好 ",
]
ALPHABET = list(" \t\n\r\u3000我们你好世界中国天气很好学习abcdehlortwxyzHW,.!。，😀é𝔘"
                + MARK) + ["  ", " 我们", "hello ", " the", "<s>", "</s>", "<unk>"]


def bilingual_spec() -> dict:
    """A Llama-style tokenizer.json: <unk>, <s>, </s>, the 256 '<0x..>' byte tokens, merges
    trained on Chinese and English text (few characters, so byte fallback is common), and
    tokens for runs of '▁' as Llama 2's vocabulary has them."""
    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    tk.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=330, limit_alphabet=45, show_progress=False))
    trained = json.loads(tk.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t in [*sorted(trained["vocab"], key=trained["vocab"].get), MARK * 2, MARK * 3,
              MARK * 4]:
        vocab.setdefault(t, len(vocab))
    runs = [[MARK, MARK], [MARK * 2, MARK], [MARK * 2, MARK * 2]]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(["<unk>", "<s>",
                                                                           "</s>"])]
    bos = [{"SpecialToken": {"id": "<s>", "type_id": 0}}]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": bos + [{"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": bos + [{"Sequence": {"id": "A", "type_id": 0}},
                                          {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1],
                                                      "tokens": ["<s>"]}}},
        "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": runs + trained["merges"]},
    }


def save(folder: Path, spec: dict, config: dict) -> Path:
    "tokenizer.json and tokenizer_config.json, as Hugging Face saves them."
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=2),
                                           encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "bos_token": {**TOKEN, "content": "<s>"}, "eos_token": {**TOKEN, "content": "</s>"},
        "unk_token": {**TOKEN, "content": "<unk>"}, "pad_token": None,
        "model_max_length": 1000000000000000019884624838656, "sp_model_kwargs": {},
        **config}, indent=2))
    return folder


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """(style, config) -> (ours or the TokenizerFileError, tokenizers, transformers)."""
    base = bilingual_spec()
    out = {}
    for style, (normalizer, pre, decoder) in STYLES.items():
        spec = dict(base, normalizer=normalizer, pre_tokenizer=pre, decoder=decoder)
        for name, config in CONFIGS.items():
            folder = save(tmp_path_factory.mktemp(style), spec, config)
            try:
                ours = Tokenizer.from_pretrained(folder)
            except TokenizerFileError as e:
                ours = e
            out[style, name] = (ours, RustTokenizer.from_file(str(folder / "tokenizer.json")),
                                AutoTokenizer.from_pretrained(folder))
    return out


def accepted(loaded) -> dict:
    return {k: v for k, v in loaded.items() if isinstance(v[0], Tokenizer)}


def same_everywhere(ours, rust, hf, text: str) -> None:
    "Ids as `tokenizers` and `transformers` give them, with and without BOS; the same text."
    for add in (True, False):
        ids = ours.encode(text, add_special_tokens=add)
        assert ids == rust.encode(text, add_special_tokens=add).ids, (text, add)
        assert ids == hf(text, add_special_tokens=add)["input_ids"], (text, add)
        for skip in (True, False):
            assert ours.decode(ids, skip) == rust.decode(ids, skip_special_tokens=skip), text
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_the_vocabulary_is_bilingual_with_byte_fallback(loaded):
    ours = loaded["llama2", "PreTrainedTokenizerFast"][0]
    tokens = [ours.id_to_token(i) for i in ours.encode("我们 love 北京 😀", False)]
    assert any("\u4e00" <= c <= "\u9fff" for t in tokens for c in t)        # Chinese tokens
    assert any(t.startswith(MARK) and t[1:].isascii() and len(t) > 2 for t in tokens)
    assert tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]         # 😀: bytes
    assert ours.encode("   x", False)[0] == ours.vocab[MARK * 4]          # '▁▁▁▁x': a run


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("config", CONFIGS)
def test_accepted_gives_the_ids_of_tokenizers_refused_names_the_field(loaded, style,
                                                                      config):
    ours, rust, hf = loaded[style, config]
    if isinstance(ours, Tokenizer):
        for text in TEXTS:
            same_everywhere(ours, rust, hf, text)
        return
    message = str(ours)
    assert config not in ("PreTrainedTokenizerFast", "no class"), message   # the file as is
    assert "tokenizer_config.json: tokenizer_class 'LlamaTokenizer'" in message
    assert any(f"tokenizer.json's {field} " in message
               for field in ("normalizer", "pre_tokenizer", "decoder"))
    assert "tokenizer.json" in message.split(":")[0]                     # the file's path


def test_what_is_accepted(loaded):
    "The file as it is, always; a LlamaTokenizer config only where transformers agrees."
    llama = {k for k in accepted(loaded) if k[1] not in ("PreTrainedTokenizerFast",
                                                         "no class")}
    assert llama == {("first", "LlamaTokenizer"), ("first", "not legacy"),
                     ("always", "legacy"), ("never", "no prefix")}
    assert len(accepted(loaded)) == 2 * len(STYLES) + len(llama)


def test_llama2_file_with_llamatokenizer_config_is_refused(loaded):
    """The reviewed case: Llama 2's (and Chinese-LLaMA's) normalizer, and the tokenizer class
    their tokenizer_config.json names. transformers replaces the normalizer by a Metaspace
    pre-tokenizer, and then it and `tokenizers` disagree on text that starts with a space."""
    for config in ("LlamaTokenizer", "legacy", "not legacy", "no prefix"):
        ours, rust, hf = loaded["llama2", config]
        assert isinstance(ours, TokenizerFileError), config
        assert "normalizer" in str(ours) and "Prepend" in str(ours)
        assert "PreTrainedTokenizerFast" in str(ours)                     # the way out
        assert any(hf(t)["input_ids"] != rust.encode(t).ids
                   for t in (" 你好", "  hello", "<s> x")), config
    _, rust, hf = loaded["llama2", "not legacy"]
    assert hf(" 你好")["input_ids"] == hf("你好")["input_ids"]              # the space is lost
    assert rust.encode(" 你好").ids != rust.encode("你好").ids


def test_refused_before_any_work(tmp_path, monkeypatch):
    spec = dict(bilingual_spec(), normalizer=LLAMA2_NORMALIZER, decoder=SP_DECODER)
    folder = save(tmp_path, spec, CONFIGS["LlamaTokenizer"])

    def build(self):
        raise AssertionError("the tables were built before the refusal")
    monkeypatch.setattr(Tokenizer, "_build", build)
    with pytest.raises(TokenizerFileError, match="tokenizer_class 'LlamaTokenizer'"):
        Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("where", ["pre_tokenizer", "decoder"])
def test_metaspace_add_prefix_space_false_needs_prepend_scheme_never(tmp_path, where):
    "`tokenizers` refuses this Metaspace (no prepend_scheme means 'always'); so do we."
    spec = dict(bilingual_spec(), pre_tokenizer=metaspace("never", True),
                decoder=SP_DECODER)
    spec[where] = {"type": "Metaspace", "replacement": MARK, "add_prefix_space": False}
    with pytest.raises(Exception):                      # the decoder's message is vaguer
        RustTokenizer.from_str(json.dumps(spec))
    folder = save(tmp_path, spec, {})
    with pytest.raises(TokenizerFileError, match=f"{where}.*add_prefix_space.*'always'"):
        Tokenizer.from_pretrained(folder)
    spec[where]["prepend_scheme"] = "never"
    ours, rust = Tokenizer.from_pretrained(save(tmp_path, spec, {})), RustTokenizer.from_str(
        json.dumps(spec))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == rust.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=True) == rust.decode(ids), text


def test_llama2_style_round_trip(loaded):
    "Prepend + Replace keeps every space: decode(encode(x)) == x (what SentencePiece does)."
    ours, rust, _ = loaded["llama2", "PreTrainedTokenizerFast"]
    for text in TEXTS:
        if MARK in text or "<" in text:
            continue
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == text == rust.decode(ids)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=14).map("".join)
       | st.text(alphabet=st.characters(codec="utf-8"), max_size=12))
def test_same_ids_on_random_text(loaded, text):
    for ours, rust, hf in accepted(loaded).values():
        same_everywhere(ours, rust, hf, text)
