"""plan_parallel (chapter 13): how many GPUs a model needs, and how to split it."""
from __future__ import annotations

import dataclasses
import math

import pytest

from minillm.memory import GPU_MEMORY_MIB, PRESETS, GiB, parameter_count, weight_bytes
from minillm.parallel.plan import (
    BIG_MODELS, MAX_NODES, ParallelPlan, plan_parallel, plan_table)

H100 = GPU_MEMORY_MIB["H100"] * 2**20
H200 = GPU_MEMORY_MIB["H200"] * 2**20


def budget(gpu_bytes: int, utilization: float = 0.9) -> int:
    return math.floor(gpu_bytes * utilization)


def kv_per_token(config: dict, tp: int, pp: int, size: int = 2) -> int:
    """Bytes of K and V per token on one GPU, written out independently."""
    layers = math.ceil(config["num_hidden_layers"] / pp)
    heads = max(1, config["num_key_value_heads"] // tp)
    return 2 * layers * heads * config["head_dim"] * size


def test_big_models_have_the_published_sizes():
    sizes = {name: parameter_count(config) for name, config in BIG_MODELS.items()}
    assert sizes["Llama-3.1-70B"] == pytest.approx(70.6e9, rel=0.01)
    assert sizes["Llama-3.1-405B"] == pytest.approx(405.8e9, rel=0.01)
    for config in BIG_MODELS.values():
        assert set(config) == set(PRESETS["Llama-3.1-8B"])
    assert not set(BIG_MODELS) & set(PRESETS)  # memory.PRESETS is left as it was


def test_a_7b_model_needs_one_h100():
    plan = plan_parallel("Llama-2-7B", "H100")
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 1)
    assert (plan.gpus, plan.nodes) == (1, 1)
    assert plan.weight_bytes_per_gpu == weight_bytes(PRESETS["Llama-2-7B"], "bfloat16")
    assert plan.command == "vllm serve Llama-2-7B --tensor-parallel-size 1"


def test_70b_needs_two_h100s_with_a_short_context():
    # 131.4 GiB of bfloat16 weights: more than one 71.7 GiB budget (0.9 * 79.6 GiB),
    # less than two with 8192 tokens of KV (65.7 + 1.25 GiB per GPU): tp=2, not 4.
    config, plan = BIG_MODELS["Llama-3.1-70B"], plan_parallel("Llama-3.1-70B", "H100")
    weights = weight_bytes(config, "bfloat16")
    assert weights > budget(H100)
    assert weights / 2 + 8192 * kv_per_token(config, 2, 1) <= budget(H100)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (2, 1)
    assert plan.kv_tokens == (budget(H100) - weights // 2) // kv_per_token(config, 2, 1)
    # one full 131072-token request needs 20 GiB of KV at tp=2: then tp=4
    full = plan_parallel("Llama-3.1-70B", "H100", max_model_len=131072)
    assert weights / 2 + 131072 * kv_per_token(config, 2, 1) > budget(H100)
    assert full.tensor_parallel_size == 4 and full.kv_tokens >= 131072
    # vLLM's headroom matters: at 0.8 of each GPU, two are not enough either
    tight = plan_parallel("Llama-3.1-70B", "H100", gpu_memory_utilization=0.8)
    assert tight.tensor_parallel_size == 4


def test_405b_needs_two_machines_of_h100s():
    config = BIG_MODELS["Llama-3.1-405B"]
    assert weight_bytes(config, "bfloat16") > 8 * budget(H100)  # 756 GiB > 8 x 71.7
    plan = plan_parallel("Llama-3.1-405B", "H100",
                         hub_id="meta-llama/Llama-3.1-405B-Instruct")
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (8, 2)
    assert (plan.gpus, plan.nodes) == (16, 2)
    assert plan.command == ("vllm serve meta-llama/Llama-3.1-405B-Instruct "
                            "--tensor-parallel-size 8 --pipeline-parallel-size 2 "
                            "--distributed-executor-backend ray")
    # each stage holds 63 of the 126 layers' KV, one KV head per GPU
    assert plan.kv_tokens == plan.kv_bytes_per_gpu // (2 * 63 * 1 * 128 * 2)


def test_405b_on_h200s():
    # bfloat16: 756 GiB fit on one machine of 8 H200s (94.5 of 126.4 GiB per GPU)
    bf16 = plan_parallel("Llama-3.1-405B", "H200")
    assert (bf16.gpus, bf16.nodes, bf16.pipeline_parallel_size) == (8, 1, 1)
    assert "--pipeline" not in bf16.command and "ray" not in bf16.command
    # int8: 378 GiB are more than two 126.4 GiB budgets, so tp=4 (94.5 GiB each).
    # The KV cache stays float16 (memory_report's rule): 2 of the 8 KV heads per GPU
    # times 126 layers times 128 x 2 bytes, for K and V.
    int8 = plan_parallel("Llama-3.1-405B", "H200", dtype="int8")
    weights = weight_bytes(BIG_MODELS["Llama-3.1-405B"], "int8")
    assert 2 * budget(H200) < weights < 4 * budget(H200)
    assert (int8.tensor_parallel_size, int8.pipeline_parallel_size) == (4, 1)
    assert int8.weight_bytes_per_gpu == weights // 4
    assert int8.kv_tokens == int8.kv_bytes_per_gpu // (2 * 126 * 2 * 128 * 2)


def test_gpu_memory_by_name_or_in_bytes_gives_the_same_plan():
    assert plan_parallel("Llama-3.1-70B", H100) == plan_parallel("Llama-3.1-70B",
                                                                 "H100")
    plan = plan_parallel("Llama-3.1-8B", "H100")
    assert plan.weight_bytes_per_gpu + plan.kv_bytes_per_gpu == budget(H100)


def test_a_config_dict_is_planned_like_its_name():
    config = {**BIG_MODELS["Llama-3.1-70B"], "_name_or_path": "my/70b"}
    plan = plan_parallel(config, "H100")
    by_name = plan_parallel("Llama-3.1-70B", "H100")
    assert plan.model == "my/70b" and plan.command.startswith("vllm serve my/70b ")
    assert dataclasses.replace(plan, model="x", hub_id="x") == dataclasses.replace(
        by_name, model="x", hub_id="x")


@pytest.mark.parametrize("model,gpu", [
    ("Llama-2-7B", "H100"), ("Llama-3.1-70B", "H100"), ("Llama-3.1-405B", "H100"),
    ("Llama-3.1-405B", "A100-40GB"), ("Llama-3.1-70B", "T4")])
def test_the_gpus_hold_all_the_weights(model, gpu):
    plan = plan_parallel(model, gpu)
    weights = weight_bytes({**PRESETS, **BIG_MODELS}[model], "bfloat16")
    assert weights <= plan.weight_bytes_per_gpu * plan.gpus < weights + plan.gpus
    assert plan.gpus == plan.tensor_parallel_size * plan.pipeline_parallel_size
    assert plan.nodes == math.ceil(plan.gpus / 8)
    assert plan.weight_bytes_per_gpu + plan.kv_bytes_per_gpu == budget(
        GPU_MEMORY_MIB[gpu] * 2**20)


def test_more_kv_tokens_take_more_gpus_and_more_gpus_hold_more_tokens():
    plans = [plan_parallel("Llama-3.1-70B", "H100", min_kv_tokens=n)
             for n in (8192, 100_000, 1_000_000, 3_000_000)]
    assert [(p.tensor_parallel_size, p.pipeline_parallel_size) for p in plans] == [
        (2, 1), (4, 1), (8, 1), (8, 2)]
    assert all(a.kv_tokens < b.kv_tokens for a, b in zip(plans, plans[1:]))
    assert all(p.kv_tokens >= n for p, n in zip(plans, (8192, 100_000, 1_000_000,
                                                         3_000_000)))
    assert plans[-1].nodes == 2 and "ray" in plans[-1].command


def test_uneven_stages_size_the_kv_cache_by_the_biggest():
    # 80 layers in 3 stages: 27, 27 and 26; every GPU's pool is sized for 27
    plan = plan_parallel("Llama-3.1-70B", "H100", min_kv_tokens=4_000_000)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (8, 3)
    assert plan.kv_tokens == plan.kv_bytes_per_gpu // (2 * 27 * 1 * 128 * 2)


def test_copied_kv_heads_add_gpus_but_no_kv_room():
    # 2 KV heads over tp=4: every GPU holds one KV head (vLLM copies each onto two)
    config = {**PRESETS["Llama-3.1-8B"], "num_key_value_heads": 2}
    plan = plan_parallel(config, 12 * GiB, min_kv_tokens=300_000)
    assert plan.tensor_parallel_size == 4
    assert plan.kv_tokens == plan.kv_bytes_per_gpu // (2 * 32 * 1 * 128 * 2)


def test_pipeline_stages_are_whole_machines():
    plan = plan_parallel("Llama-3.1-70B", "H100", gpus_per_node=1)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (1, 2)
    assert plan.nodes == 2
    assert plan.command == ("vllm serve Llama-3.1-70B --tensor-parallel-size 1 "
                            "--pipeline-parallel-size 2 "
                            "--distributed-executor-backend ray")
    four = plan_parallel("Llama-3.1-405B", "H100", gpus_per_node=4)
    assert (four.tensor_parallel_size, four.pipeline_parallel_size) == (4, 3)
    assert four.gpus == 12 and four.nodes == 3


def test_the_plan_is_frozen():
    plan = plan_parallel("Llama-2-7B", "H100")
    assert isinstance(plan, ParallelPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.gpus = 2


def test_plan_table_rows():
    rows = plan_table(["Llama-2-7B", "Llama-3.1-405B"], "H100", dtype="int8")
    assert [r["model"] for r in rows] == ["Llama-2-7B", "Llama-3.1-405B"]
    plan = plan_parallel("Llama-3.1-405B", "H100", dtype="int8")
    assert rows[1] == {"model": "Llama-3.1-405B", "params (B)": 405.9,
                       "weights (GiB)": 378.0, "tp": 8, "pp": 1, "gpus": 8,
                       "nodes": 1, "weights per GPU (GiB)": 47.2,
                       "KV tokens": plan.kv_tokens}
    assert rows[0]["tp"] == 1 and rows[0]["weights (GiB)"] == 6.3


@pytest.mark.parametrize("kwargs,message", [
    (dict(model="Llama-4"), r"model='Llama-4' is unknown; allowed: .*Llama-3\.1-405B"),
    (dict(model=7), r"model=7 is unknown"),
    (dict(gpu_memory="B200"), r"gpu_memory='B200' is unknown; allowed: .*'H200'"),
    (dict(gpu_memory=0), r"gpu_memory \(bytes\)=0: must be a positive integer"),
    (dict(gpu_memory=-5), r"gpu_memory \(bytes\)=-5: must be a positive integer"),
    (dict(gpu_memory=80e9), r"gpu_memory \(bytes\)=80000000000\.0: must be a positive"),
    (dict(gpu_memory=True), r"gpu_memory \(bytes\)=True: must be a positive integer"),
    (dict(dtype="float64"), r"dtype='float64' is not supported; allowed: .*'int8'"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization=0: must be .*\(0, 1\]"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1\.5: must be"),
    (dict(gpu_memory_utilization="0.9"), r"gpu_memory_utilization='0\.9': must be"),
    (dict(max_model_len=200_000), r"max_model_len=200000 is beyond the model's "
                                  r"max_position_embeddings=131072; allowed: 1 to"),
    (dict(model="Llama-2-7B", max_model_len=8192), r"max_model_len=8192 is beyond .*"
                                                   r"=4096"),
    (dict(max_model_len=0), r"max_model_len=0: must be a positive integer"),
    (dict(min_kv_tokens=100), r"min_kv_tokens=100 is less than max_model_len=8192"),
    (dict(min_kv_tokens=2.5), r"min_kv_tokens=2\.5: must be a positive integer"),
    (dict(gpus_per_node=0), r"gpus_per_node=0: must be a positive integer"),
    (dict(hub_id=""), r"hub_id='': must be a non-empty string"),
    (dict(gpu_memory=100 * 2**20), r"model Llama-3\.1-70B .* does not fit on 64 "
                                   r"machines of 8 GPUs of 0\.1 GiB"),
    (dict(model={**PRESETS["Llama-2-7B"], "hidden_size": None}),
     r"missing the field 'hidden_size'"),
])
def test_bad_arguments_are_refused(kwargs, message):
    args = dict(model="Llama-3.1-70B", gpu_memory="H100") | kwargs
    with pytest.raises(ValueError, match=message):
        plan_parallel(**args)


def test_nothing_fits_names_the_limit():
    # 405B on 64 x 8 GPUs of 1 GiB: 756 GiB of weights > 512 x 0.9 GiB
    assert MAX_NODES == 64
    with pytest.raises(ValueError, match=r"does not fit on 64 machines of 8"):
        plan_parallel("Llama-3.1-405B", GiB)
    plan = plan_parallel("Llama-3.1-405B", 2 * GiB)  # 512 x 1.8 GiB would be enough
    weights = weight_bytes(BIG_MODELS["Llama-3.1-405B"], "bfloat16")
    stages = plan.pipeline_parallel_size  # the fewest 8-GPU machines that hold it
    assert weights / (8 * (stages - 1)) > budget(2 * GiB) > weights / (8 * stages)
    assert plan.nodes == stages < MAX_NODES and plan.tensor_parallel_size == 8
