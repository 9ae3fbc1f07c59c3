"""The memory formulas of Chapter 0, checked against hand-computed values."""
import pytest
import torch

from minillm.memory import (GPUS_GB, PRESETS, dtype_bytes, head_dim, kv_cache_bytes, memory_report,
                            parameter_count, weight_bytes)

LLAMA2_7B_LIKE = {"num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 128}


class AttrConfig:
    """An object-style config, like transformers.PretrainedConfig."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_source_article_example_is_one_gib():
    assert kv_cache_bytes(LLAMA2_7B_LIKE, seq_len=2048, batch_size=1, dtype="float16") == 1 << 30


def test_llama31_8b_is_128_kib_per_token():
    assert kv_cache_bytes(PRESETS["Llama-3.1-8B"], seq_len=1, dtype=torch.float16) == 128 * 1024


def test_kv_formula_by_hand():
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48}
    # 2 (K and V) * 3 layers * 2 kv heads * 8 head_dim * 5 tokens * 4 batch * 4 bytes
    assert kv_cache_bytes(cfg, seq_len=5, batch_size=4, dtype="float32") == 2 * 3 * 2 * 8 * 5 * 4 * 4


def test_gqa_uses_kv_heads_not_query_heads():
    mha = {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 16}
    gqa = dict(mha, num_key_value_heads=2)
    assert kv_cache_bytes(mha, 10) == 4 * kv_cache_bytes(gqa, 10)


def test_dict_and_object_configs_agree():
    cfg = PRESETS["Qwen2.5-0.5B"]
    assert kv_cache_bytes(AttrConfig(**cfg), 100, 2) == kv_cache_bytes(cfg, 100, 2)
    assert weight_bytes(AttrConfig(**cfg), "bfloat16") == weight_bytes(cfg, "bfloat16")


def test_head_dim_derived_from_hidden_size():
    assert head_dim({"hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert head_dim({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 64}) == 64


@pytest.mark.parametrize("name,size", [("float32", 4), ("float16", 2), ("bfloat16", 2), ("int8", 1),
                                       (torch.float32, 4), (torch.bfloat16, 2), (torch.int8, 1)])
def test_dtype_bytes(name, size):
    assert dtype_bytes(name) == size


def test_parameter_count_by_hand():
    cfg = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
           "vocab_size": 10, "intermediate_size": 12, "tie_word_embeddings": False}
    hd = 4
    attention = 8 * 2 * hd * 2 + 8 * 1 * hd * 2      # q, o + k, v
    per_layer = attention + 3 * 8 * 12 + 2 * 8        # + MLP + two norms
    expected = 2 * 10 * 8 + 2 * per_layer + 8           # untied embeddings + layers + final norm
    assert parameter_count(cfg) == expected
    assert parameter_count(dict(cfg, tie_word_embeddings=True)) == expected - 80
    assert parameter_count(dict(cfg, attention_bias=True)) == expected + 2 * (2 * hd + 2 * hd)


@pytest.mark.parametrize("name,count", [("Llama-2-7B", 6_738_415_616), ("Llama-3.1-8B", 8_030_261_248),
                                        ("TinyLlama-1.1B", 1_100_048_384), ("Qwen2.5-0.5B", 494_032_768),
                                        ("SmolLM2-135M", 134_515_008)])
def test_presets_match_published_parameter_counts(name, count):
    assert parameter_count(PRESETS[name]) == count


def test_weight_bytes_int8_is_half_of_float16():
    cfg = PRESETS["Llama-3.1-8B"]
    assert weight_bytes(cfg, "float16") == 2 * weight_bytes(cfg, "int8")


def test_memory_report_fits():
    report = memory_report("Llama-3.1-8B", "float16", 8192, 1, "L4 24 GB")
    assert report["fits"] and report["kv_cache_GiB"] == pytest.approx(1.0)
    assert not memory_report("Llama-2-7B", "float16", 4096, 2, "T4 16 GB")["fits"]
    assert set(GPUS_GB) == {"T4 16 GB", "L4 24 GB", "A100 40 GB", "A100 80 GB", "H100 80 GB"}


@pytest.mark.parametrize("kwargs,field", [
    ({"seq_len": 0}, "seq_len"), ({"seq_len": -5}, "seq_len"), ({"seq_len": 2.5}, "seq_len"),
    ({"seq_len": 8, "batch_size": 0}, "batch_size"), ({"seq_len": 8, "dtype": "fp8"}, "fp8"),
    ({"seq_len": 8, "dtype": torch.float64}, "float64"),
])
def test_bad_arguments_name_the_value(kwargs, field):
    with pytest.raises(ValueError, match=field):
        kv_cache_bytes(PRESETS["SmolLM2-135M"], **kwargs)


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads"])
def test_missing_config_field_is_named(missing):
    cfg = dict(LLAMA2_7B_LIKE)
    del cfg[missing]
    with pytest.raises(ValueError, match=missing):
        kv_cache_bytes(cfg, 16)


def test_missing_head_dim_and_hidden_size():
    with pytest.raises(ValueError, match="hidden_size"):
        kv_cache_bytes({"num_hidden_layers": 2, "num_attention_heads": 4}, 16)
    with pytest.raises(ValueError, match="vocab_size"):
        weight_bytes({k: v for k, v in PRESETS["SmolLM2-135M"].items() if k != "vocab_size"})


def test_bad_config_values():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        kv_cache_bytes(dict(LLAMA2_7B_LIKE, num_key_value_heads=0), 16)
    with pytest.raises(ValueError, match="not divisible"):
        head_dim({"hidden_size": 100, "num_attention_heads": 3})


def test_memory_report_rejects_unknown_names():
    with pytest.raises(ValueError, match="GPT-5"):
        memory_report("GPT-5")
    with pytest.raises(ValueError, match="V100"):
        memory_report("Llama-3.1-8B", gpu="V100")
