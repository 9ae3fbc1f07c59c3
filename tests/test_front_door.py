"""Issue 38, item 2: vLLM's offline front door as vLLM users type it. Prompt dicts and
TokensPrompt / TextPrompt, LLM.get_tokenizer(), SamplingParams(max_tokens=None),
vLLM's common LLM(...) arguments, and the package's names visible to dir()."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import minillm
from minillm.engine.llm import LLM
from minillm.sampling import SamplingParams

SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tiny-shakespeare"
GREEDY = SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(SHAKESPEARE), device="cpu", max_num_seqs=4)


def answers(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_dicts_answer_like_plain_prompts(llm):
    text = "ROMEO:\nWhat light"
    ids = llm.get_tokenizer().encode(text)
    plain = answers(llm.generate([text], GREEDY, use_tqdm=False))[0]
    forms = [{"prompt": text}, {"prompt_token_ids": ids},
             minillm.TextPrompt(prompt=text),
             minillm.TokensPrompt(prompt_token_ids=ids)]
    outs = llm.generate(forms + [text, ids], GREEDY, use_tqdm=False)
    assert answers(outs) == [plain] * 6
    assert outs[0].prompt == text and outs[2].prompt == text
    assert outs[1].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert len(one) == 1 and answers(one) == [plain]


def test_typed_dicts_importable_where_vllm_has_them():
    from minillm import TextPrompt, TokensPrompt
    from minillm.inputs import TextPrompt as T2, TokensPrompt as T3
    assert TextPrompt is T2 and TokensPrompt is T3
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}


@pytest.mark.parametrize("bad, words", [
    ({"text": "hi"}, "'text'"),
    ({"prompt": 3}, "3"),
    ({"prompt_token_ids": "abc"}, "abc"),
    ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data"),
    (3.5, "3.5"),
    ([{"prompt": "hi"}, object], "object"),
])
def test_other_prompts_refused_naming_the_value(llm, bad, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(bad, GREEDY, use_tqdm=False)
    assert not llm.engine.requests


def test_get_tokenizer(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    assert tok.decode(tok.encode("ROMEO")).endswith("ROMEO")


def test_dir_lists_the_public_names():
    names = dir(minillm)
    for name in ("LLM", "LLMEngine", "SamplingParams", "RequestOutput",
                 "CompletionOutput", "TokensPrompt", "TextPrompt", "__version__"):
        assert name in names


def test_vllm_arguments_accepted_where_they_mean_something():
    llm = LLM(str(SHAKESPEARE), device="cpu", dtype="auto", enforce_eager=True,
              tensor_parallel_size=1, trust_remote_code=False, max_num_seqs=2)
    from minillm.perf.dtype_auto import cpu_auto_dtype  # chapter 7 appendix: the measured rule
    assert llm.engine.model.lm_head.weight.dtype == \
        cpu_auto_dtype(None, torch.device("cpu"))
    assert not llm.engine.requests and llm.engine.max_model_len > 0
    LLM(llm.engine.model, llm.get_tokenizer(), dtype="auto", enforce_eager=False,
        trust_remote_code=True, max_num_seqs=2)  # a loaded model: "auto" is no dtype


@pytest.mark.parametrize("kwargs, words", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3: this model has 2 KV"),
    (dict(tensor_parallel_size=1.5), "tensor_parallel_size=1.5"),
    (dict(enforce_eager="yes"), "enforce_eager='yes'"),
    (dict(trust_remote_code=1), "trust_remote_code=1"),
    (dict(enforce_eager=True, cuda_graphs=True), "contradict"),
    (dict(enforce_eager=True, compile_decode=True), "compile_decode=True contradict"),
    (dict(enforce_eager=True, compile_decode={"buckets": [1]}), "contradict"),
    (dict(dtype="float3"), "float3"),
])
def test_vllm_arguments_refused_where_they_do_not(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LLM(str(SHAKESPEARE), device="cpu", max_num_seqs=2, **kwargs)
