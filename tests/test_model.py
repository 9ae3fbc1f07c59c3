"""minillm.model.transformer: config parsing, loading, and logits equal to transformers on tiny random models."""
import json
import re
import warnings

import pytest
import torch
import transformers

from helpers import FAMILIES, TINY, make_hf_model
from minillm.model.config import ModelConfig
from minillm.model.loader import load_model
from minillm.model.transformer import StepMeta, Transformer

torch.set_num_threads(1)


def make_hf(family: str, folder, **save):
    return make_hf_model(folder, family, "random_norms", save=save)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def max_diff(model, hf, prompts) -> float:
    diff = 0.0
    for ids in prompts:
        with torch.inference_mode():
            ours = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
        diff = max(diff, (ours - hf_logits(hf, ids)).abs().max().item())
    return diff


PROMPTS = [[1, 5, 9, 23, 7, 88, 3], [2, 40], list(range(3, 60))]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parity_with_transformers(family, tmp_path):
    hf = make_hf(family, tmp_path)
    model = load_model(tmp_path, device="cpu")
    assert next(model.parameters()).dtype == torch.float32
    assert max_diff(model, hf, PROMPTS) < 1e-4


def test_sharded_checkpoint_and_logits_index(tmp_path):
    hf = make_hf("llama_gqa_untied", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_model(tmp_path, device="cpu")
    assert max_diff(model, hf, PROMPTS) < 1e-4
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        meta = StepMeta(pos, logits_index=torch.tensor([ids.shape[1] - 1]))
        full, last = model(ids, pos), model(ids, pos, meta=meta)
    assert last.shape == (1, 1, TINY["vocab_size"])
    torch.testing.assert_close(last[:, 0], full[:, -1])


def test_batch_of_equal_length_prompts(tmp_path):
    hf = make_hf("qwen2_bias_tied", tmp_path)
    model = load_model(tmp_path, device="cpu")
    ids = torch.tensor([[4, 8, 15, 16, 23, 42], [1, 2, 3, 4, 5, 6]])
    pos = torch.arange(6).expand(2, 6)
    with torch.inference_mode():
        ours = model(ids, pos)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


class RecordingKV:
    """A kv object that keeps everything it is given: checks the backend contract
    (store k and v, return attention of q over the row; meta carries the positions)."""
    def __init__(self):
        self.k, self.v, self.calls = {}, {}, []

    def attend(self, layer_idx, q, k, v, meta):
        self.calls.append((layer_idx, tuple(k.shape), tuple(v.shape), meta.positions.tolist()))
        if layer_idx in self.k:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=2)
        else:
            self.k[layer_idx], self.v[layer_idx] = k, v
        S, T = self.k[layer_idx].shape[2], k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)  # causal over the cached prefix
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.k[layer_idx], self.v[layer_idx], attn_mask=mask, enable_gqa=True)


def test_kv_backend_contract_gives_the_same_logits(tmp_path):
    make_hf("llama_gqa_untied", tmp_path)
    model = load_model(tmp_path, device="cpu")
    ids = torch.tensor([PROMPTS[2][:12]])
    kv = RecordingKV()
    with torch.inference_mode():
        full = model(ids, torch.arange(12)[None])
        first = model(ids[:, :8], torch.arange(8)[None], kv=kv, meta=StepMeta(torch.arange(8)[None]))
        rest = []
        for t in range(8, 12):
            meta = StepMeta(torch.tensor([[t]]), logits_index=torch.tensor([0]))
            rest.append(model(ids[:, t:t + 1], meta.positions, kv=kv, meta=meta))
    # each layer receives K/V with n_kv_heads (not repeated to the query heads), and the meta
    assert kv.calls[0] == (0, (1, 2, 8, 16), (1, 2, 8, 16), [list(range(8))])
    assert [c[0] for c in kv.calls[:2]] == [0, 1]
    torch.testing.assert_close(first, full[:, :8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(rest, dim=1), full[:, 8:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="meta=StepMeta"):
        model(ids, torch.arange(12)[None], kv=kv)


def test_config_from_hf_fields(tmp_path):
    config = transformers.LlamaConfig(**TINY, rope_theta=123.0, eos_token_id=[2, 7], bos_token_id=1)
    config.save_pretrained(tmp_path)
    c = ModelConfig.from_hf(tmp_path)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.rope_theta == 123.0 and c.eos_token_ids == [2, 7] and c.bos_token_id == 1
    # old-style files keep rope_theta / rope_scaling at the top level
    old = json.loads((tmp_path / "config.json").read_text())
    old.pop("rope_parameters", None)
    old.update(rope_theta=10.0, rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=64))
    c = ModelConfig.from_hf(old)
    assert c.rope_theta == 10.0 and c.rope_scaling["factor"] == 8.0


def test_eos_ids_also_come_from_generation_config(tmp_path):
    transformers.LlamaConfig(**TINY, eos_token_id=2).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert ModelConfig.from_hf(tmp_path).eos_token_ids == [2, 9]


def test_mistral_sliding_window_caps_the_context():
    c = ModelConfig.from_hf(dict(model_type="mistral", **TINY, sliding_window=32))
    assert c.context_length == 32
    c = ModelConfig.from_hf(dict(model_type="qwen2", **TINY, sliding_window=32, use_sliding_window=False))
    assert c.context_length == 128


@pytest.mark.parametrize("change, field", [
    (dict(model_type="gpt2"), "gpt2"),
    (dict(rope_scaling=dict(type="yarn", factor=2.0)), "yarn"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(type="llama3", factor=2.0)), "llama3"),
])
def test_config_rejects_what_it_cannot_run(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf({"model_type": "llama", **TINY, **change})


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype=torch.int8, device="cpu")


def test_load_model_offline_repo_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        load_model("some-org/some-model")


def test_load_model_dtypes(tmp_path):
    hf = make_hf("qwen2_bias_tied", tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.embed_tokens.weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = load_model(tmp_path, dtype=torch.float16, device="cpu")
    assert half.embed_tokens.weight.dtype == torch.float16
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPTS[0]]), torch.arange(7)[None]).float()
    assert (logits - hf_logits(hf, PROMPTS[0])).abs().max().item() < 0.2


def test_random_init_model_runs():
    c = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=1, head_dim=8, max_position_embeddings=64)
    model = Transformer(c).eval()
    with torch.inference_mode():
        out = model(torch.zeros(3, 5, dtype=torch.long), torch.arange(5).expand(3, 5))
    assert out.shape == (3, 5, 50) and torch.isfinite(out).all()


def test_bundled_model_logits_equal_transformers():
    from minillm.utils import bundled_model_path
    folder = bundled_model_path()
    assert (folder / "config.json").is_file(), f"the bundled model is missing from {folder}"
    model = load_model(folder, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    V = model.config.vocab_size
    prompts = [[(13 * i + 5) % V for i in range(n)] for n in (1, 17, 64)]
    assert max_diff(model, hf, prompts) < 1e-4


def test_load_model_fetches_a_repo_id_through_the_hub(tmp_path, monkeypatch):
    import huggingface_hub
    hf = make_hf("mistral", tmp_path / "snapshot")
    asked = []
    def fake_snapshot_download(repo_id, **kw):
        asked.append(repo_id)
        return str(tmp_path / "snapshot")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model = load_model("mistralai/tiny-test", device="cpu")
    assert asked == ["mistralai/tiny-test"]
    assert max_diff(model, hf, PROMPTS[:1]) < 1e-4


# ---- bad checkpoints: a clear error naming the file and the field, before any weight is loaded ----

BAD_CONFIG = [  # (change to config.json, the field, the value the message must show)
    (dict(vocab_size=None), "vocab_size", "lacks"),
    (dict(vocab_size="101"), "vocab_size", "'101'"),
    (dict(hidden_size=64.0), "hidden_size", "64.0"),
    (dict(num_hidden_layers=True), "num_hidden_layers", "True"),
    (dict(num_attention_heads=0), "num_attention_heads", "0"),
    (dict(num_key_value_heads=3), "num_key_value_heads", "3"),
    (dict(head_dim=15), "head_dim", "15"),
    (dict(rope_theta=0.0, rope_parameters=None), "rope_theta", "0.0"),
    (dict(rope_theta=-10000.0, rope_parameters=None), "rope_theta", "-10000.0"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=-1.0)), "rope_theta", "-1.0"),
    (dict(rope_parameters="fast"), "rope_parameters", "'fast'"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps", "-1e-06"),
    (dict(rms_norm_eps=0), "rms_norm_eps", "0"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps", "'1e-6'"),
    (dict(max_position_embeddings=0), "max_position_embeddings", "0"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window", "0"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings", "'yes'"),
    (dict(attention_bias=1), "attention_bias", "1"),
    (dict(eos_token_id=101), "eos_token_id", "101"),
    (dict(eos_token_id=[2, -1]), "eos_token_id", "[2, -1]"),
    (dict(eos_token_id="</s>"), "eos_token_id", "'</s>'"),
    (dict(bos_token_id=500), "bos_token_id", "500"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=0.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=32)), "factor", "0.0"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=4.0,
                               high_freq_factor=4.0, original_max_position_embeddings=32)),
     "high_freq_factor", "4.0"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=0)),
     "original_max_position_embeddings", "0"),
    (dict(torch_dtype=16, dtype=None), "torch_dtype", "16"),
]


def write_config(folder, **change):
    transformers.LlamaConfig(**TINY).save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(change)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


@pytest.mark.parametrize("change, field, shown", BAD_CONFIG)
def test_bad_config_names_file_field_and_value(tmp_path, change, field, shown):
    path = write_config(tmp_path, **change)
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf(tmp_path)
    message = str(info.value)
    assert str(path) in message and field in message and shown in message, message


@pytest.mark.parametrize("text, shown", [("{not json", "not valid JSON"), ("[1, 2]", "JSON list"),
                                         ("", "not valid JSON")])
def test_config_file_that_is_not_an_object(tmp_path, text, shown):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(shown)) as info:
        ModelConfig.from_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_generation_config_eos_outside_the_vocabulary(tmp_path):
    write_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4000]}))
    with pytest.raises(ValueError, match="generation_config.json.*eos_token_id.*4000"):
        ModelConfig.from_hf(tmp_path)


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the loader allocates the model's storage."""
    def refuse(*args, **kwargs):
        pytest.fail("load_model allocated the model before it found the problem")
    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)


def test_truncated_safetensors_fails_before_loading(tmp_path, no_allocation):
    make_hf("llama_gqa_untied", tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-1000])  # a download cut short
    with pytest.raises(ValueError, match="truncated") as info:
        load_model(tmp_path, device="cpu")
    assert str(file) in str(info.value)
    for cut in (data[:5], data[:20], b""):  # not even a whole header
        file.write_bytes(cut)
        with pytest.raises(ValueError, match=re.escape(str(file))):
            load_model(tmp_path, device="cpu")


def test_header_that_is_not_json(tmp_path, no_allocation):
    make_hf("llama_gqa_untied", tmp_path)
    file = tmp_path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="header") as info:
        load_model(tmp_path, device="cpu")
    assert str(file) in str(info.value)


@pytest.mark.parametrize("shard", ["../evil.safetensors", "/etc/evil.safetensors", "a/../../evil.safetensors",
                                   "C:evil.safetensors", ""])
def test_index_may_only_name_files_inside_the_folder(tmp_path, shard, no_allocation):
    make_hf("llama_gqa_untied", tmp_path / "m", max_shard_size="100KB")
    index = tmp_path / "m" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    (tmp_path / "evil.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as info:
        load_model(tmp_path / "m", device="cpu")
    assert repr(shard) in str(info.value) and str(index) in str(info.value)


@pytest.mark.parametrize("weight_map", [None, [], {}, {"lm_head.weight": 3}])
def test_index_without_a_proper_weight_map(tmp_path, weight_map):
    make_hf("llama_gqa_untied", tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="weight_map"):
        load_model(tmp_path, device="cpu")


def test_a_tensor_in_two_shards(tmp_path, no_allocation):
    from safetensors.torch import load_file, save_file
    make_hf("llama_gqa_untied", tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    first, second = load_file(shards[0]), load_file(shards[1])
    twice = next(iter(first))
    second[twice] = first[twice]
    save_file(second, shards[1], metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(repr(twice)) + ".*two shards"):
        load_model(tmp_path, device="cpu")


def test_quantized_tensor_dtype_is_refused(tmp_path, no_allocation):
    from safetensors.torch import load_file, save_file
    make_hf("llama_gqa_untied", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int8)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.norm.weight' is I8"):
        load_model(tmp_path, device="cpu")


def test_wrong_shape_and_unknown_tensor(tmp_path, no_allocation):
    from safetensors.torch import load_file, save_file
    make_hf("llama_gqa_untied", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape("'model.norm.weight' has shape (3,)")):
        load_model(tmp_path, device="cpu")
    state["model.norm.weight"] = torch.ones(TINY["hidden_size"])
    state["model.extra.weight"] = torch.ones(3)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.extra.weight"):
        load_model(tmp_path, device="cpu")


def _unavailable_devices():
    devices = ["meta", "gpu", "cuda:99", "xla", "cuda:-1"]
    if not torch.cuda.is_available():
        devices += ["cuda", "cuda:0"]
    if not torch.backends.mps.is_available():
        devices += ["mps"]
    return devices


@pytest.mark.parametrize("device", _unavailable_devices())
def test_devices_this_machine_lacks(tmp_path, device, no_allocation):
    make_hf("llama_gqa_untied", tmp_path)
    with pytest.raises(ValueError) as info:
        load_model(tmp_path, device=device)
    assert repr(device) in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "float64", "fp8", torch.bool])
def test_dtypes_the_loader_refuses(tmp_path, dtype, no_allocation):
    make_hf("llama_gqa_untied", tmp_path)
    with pytest.raises(ValueError, match=re.escape(str(dtype))):
        load_model(tmp_path, dtype=dtype, device="cpu")


def test_dtype_by_name(tmp_path):
    make_hf("llama_gqa_untied", tmp_path)
    model = load_model(tmp_path, dtype="bfloat16", device="cpu")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    model = load_model(tmp_path, dtype="torch.float32", device=torch.device("cpu"))
    assert model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("path", [None, 5, ["a"]])
def test_path_must_be_a_path(path):
    with pytest.raises(ValueError, match="path is a"):
        load_model(path, device="cpu")


@pytest.mark.parametrize("field, value", [("head_dim", 15), ("num_kv_heads", 5), ("rope_theta", 0.0),
                                          ("rms_norm_eps", -1.0), ("eos_token_ids", [40000]),
                                          ("vocab_size", 0), ("max_position_embeddings", 0),
                                          ("sliding_window", 0), ("bos_token_id", -1)])
def test_model_config_built_by_hand_is_checked_too(field, value):
    with pytest.raises(ValueError) as info:
        ModelConfig(**{field: value})
    assert f"{field}={value!r}" in str(info.value)


@pytest.mark.parametrize("config", [[1, 2], 3, None])
def test_from_hf_needs_a_dict_or_a_path(config):
    with pytest.raises(ValueError, match=type(config).__name__):
        ModelConfig.from_hf(config)


def test_bf16_is_asked_of_the_given_gpu_without_emulation(monkeypatch):
    """A T4 emulates bfloat16 (slowly): torch's default check says yes to it and asks
    the current GPU. cuda_bf16 asks `device`, natively only."""
    import contextlib

    from minillm.model import loader as mm
    asked = []

    @contextlib.contextmanager
    def on(device):
        asked.append(("device", device))
        yield

    def supported(including_emulation=True):
        asked.append(("emulation", including_emulation))
        return including_emulation  # a T4: only emulated

    monkeypatch.setattr(torch.cuda, "device", on)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    assert mm.cuda_bf16(torch.device("cuda:1")) is False
    assert asked == [("device", torch.device("cuda:1")), ("emulation", False)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Tesla T4")
    with pytest.raises(ValueError, match=r"Tesla T4.*bfloat16; use torch.float16"):
        mm._check_dtype("bfloat16", torch.device("cuda:0"))
