"""The bundled model in data/tiny-shakespeare: loads offline with transformers, and its held-out
perplexity stays below the bound its model card states."""
from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minillm.tokenizer import Tokenizer
from minillm.utils import bundled_model_path, repo_root

FOLDER = bundled_model_path()


def _script():
    "data/make_tiny_model.py as a module (it holds the corpus cleaning and the evaluation)."
    spec = importlib.util.spec_from_file_location("make_tiny_model", repo_root() / "data" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(FOLDER, local_files_only=True).eval()


def test_files_present_and_small():
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "README.md"]:
        assert (FOLDER / name).is_file(), name
    total = sum(p.stat().st_size for p in FOLDER.iterdir())
    assert total < 40 * 2**20, f"{total / 2**20:.1f} MiB"


def test_config_is_a_small_llama_with_gqa(model):
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    n_params = sum(p.numel() for p in model.parameters())
    assert 5e6 <= n_params <= 10e6, n_params
    tok = Tokenizer.from_pretrained(FOLDER)
    assert config["vocab_size"] == tok.vocab_size
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)


def test_transformers_loads_offline_and_generates(model):
    hf_tok = AutoTokenizer.from_pretrained(FOLDER, local_files_only=True)
    ids = hf_tok("ROMEO:\n", return_tensors="pt").input_ids
    assert ids[0, 0].item() == hf_tok.bos_token_id            # BOS is added, as in training
    out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=hf_tok.pad_token_id)
    text = hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert len(text.strip()) > 0
    assert re.search(r"[a-z]{3}", text), text                  # real-looking words, not only bytes


def test_heldout_perplexity_below_stated_bound(model):
    card = (FOLDER / "README.md").read_text(encoding="utf-8")
    bound = float(re.search(r"Perplexity bound: ([\d.]+)", card).group(1))
    script = _script()
    tok = Tokenizer.from_pretrained(FOLDER)
    ctx = json.loads((FOLDER / "config.json").read_text())["max_position_embeddings"]
    chunks = script.heldout_chunks(tok, ctx)[:script.TEST_SLICE]
    loss, n_tokens = script.mean_loss(model, chunks, tok.pad_token_id)
    assert n_tokens >= 2000
    perplexity = math.exp(loss)
    assert perplexity < bound, f"held-out perplexity {perplexity:.1f} is not below the stated bound {bound}"
    # and far better than guessing uniformly over the vocabulary
    assert perplexity < tok.vocab_size / 10


def test_corpus_cleaning_and_held_out_plays():
    script = _script()
    scenes = script.clean_play("# Title\n\n## ACT I\n\n### SCENE I. A place.\n\n_Enter ROMEO_\n\n"
                               "**ROMEO**  \nBut, soft!  \n_\\[Aside]_  \nwhat light\n\n_Exit_\n")
    assert scenes == [["ROMEO:\nBut, soft!\nwhat light\n"]]
    names = script.play_paths()
    assert set(script.HELD_OUT) <= set(names) and len(names) - len(script.HELD_OUT) >= 30
