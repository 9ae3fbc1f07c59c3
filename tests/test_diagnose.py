"""minillm.perf.diagnose: the chapter 8 helpers, against direct computations; bad input;
chat_prompt_problems on prompts with each problem (minillm and transformers tokenizer)."""
from types import SimpleNamespace

import pytest
import torch
import transformers

from minillm.perf.diagnose import (answer_loss, chat_prompt_problems, eos_probability,
                              input_lengths, memory_triage, repeated_share, stop_cause)
from minillm.engine import LLM
from minillm.generate import generate
from minillm.memory import kv_cache_bytes, weight_bytes
from minillm.model.naive import naive_generate
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer
from minillm.utils import bundled_model_path

torch.set_num_threads(1)
LLAMA7B = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=32, vocab_size=32000)


def test_memory_triage_adds_the_three_parts():
    parts = memory_triage(LLAMA7B, requests=16, seq_len=4096, prompt_len=4096)
    assert parts == {"weights": weight_bytes(LLAMA7B, "float16"),
                     "KV cache": kv_cache_bytes(LLAMA7B, 4096, 16, "float16"),
                     "activations": 4096 * 32000 * 4}
    assert parts["KV cache"] == 16 * 2**31  # 2 GiB per 4,096-token request
    int8 = memory_triage(LLAMA7B, 16, 4096, 4096, weight_dtype="int8")
    assert int8["weights"] * 2 == parts["weights"]


@pytest.mark.parametrize("kw, match", [(dict(prompt_len=0), "prompt_len=0"),
                                       (dict(prompt_len=True), "prompt_len=True"),
                                       (dict(requests=0), "0"),
                                       (dict(weight_dtype="int3"), "int3")])
def test_memory_triage_refuses_bad_input(kw, match):
    args = dict(requests=1, seq_len=16, prompt_len=16) | kw
    with pytest.raises(ValueError, match=match):
        memory_triage(LLAMA7B, **args)


def test_input_lengths_tells_the_cache_apart(llama):
    _, model = llama
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with input_lengths(model) as naive:
        naive_generate(model, [1, 5, 9], params)
    with input_lengths(model) as cached:
        generate(model, [1, 5, 9], params)
    assert naive == [3, 4, 5, 6] and cached == [3, 1, 1, 1]
    with pytest.raises(RuntimeError):
        with input_lengths(model) as lengths:
            raise RuntimeError("boom")
    generate(model, [1, 5, 9], params)
    assert lengths == [] and not model._forward_pre_hooks  # the hook is gone


def test_repeated_share():
    assert repeated_share(list(range(20))) == 0
    assert repeated_share([1, 2, 3] * 10, n=3) == pytest.approx(1 - 3 / 28)
    assert repeated_share([7, 7], n=1) == 0.5
    for ids, n, match in [([1, 2], 3, "no 3-gram"), ([1], 0, "n=0"), ([1], 1.5, "n=1.5")]:
        with pytest.raises(ValueError, match=match):
            repeated_share(ids, n)


def test_eos_probability_is_the_softmax_at_eos(llama):
    _, model = llama
    prompt, answer = [1, 5, 9], [14, 22, 30, 2]
    x = torch.tensor([prompt + answer])
    with torch.inference_mode():
        logits = model(x, torch.arange(7)[None])[0]
    for t in (1.0, 0.5):
        want = (logits[2:6] / t).softmax(-1)[:, model.config.eos_token_ids].sum(-1)
        torch.testing.assert_close(eos_probability(model, prompt, answer, t), want)
    two = eos_probability(model, prompt, answer, eos_ids=[2, 14])
    torch.testing.assert_close(two, logits[2:6].softmax(-1)[:, [2, 14]].sum(-1))


@pytest.mark.parametrize("args, match", [
    (([1], []), "non-empty"), (([], [2]), "non-empty"), (([1], [10**6]), "ints in"),
    (([1], [2], 0), "temperature=0"), (([1], [2], 1.0, [-1]), "eos_ids")])
def test_eos_probability_refuses_bad_input(llama, args, match):
    _, model = llama
    with pytest.raises(ValueError, match=match):
        eos_probability(model, *args)


def done(reason, token_ids, stop_reason=None):
    """A finished answer, as LLM.generate returns it (only what stop_cause reads)."""
    return SimpleNamespace(finish_reason=reason, token_ids=list(token_ids),
                           stop_reason=stop_reason)


EOS2 = SimpleNamespace(eos_token_ids=[2])  # a config: EOS is id 2


def test_stop_cause_names_the_rule():
    p = SamplingParams(max_tokens=5, stop=["\n", "END"], stop_token_ids=[7])
    assert stop_cause(done("length", [4] * 5), p, EOS2) == "max_tokens=5"
    assert stop_cause(done("stop", [4, 2]), p, EOS2) == "EOS (id 2)"
    assert stop_cause(done("stop", [4, 7]), p, EOS2) == "stop id 7"
    assert stop_cause(done("stop", [4, 5], "END"), p, EOS2) == "stop string 'END'"
    assert stop_cause(done("stop", [4, 5], "\n"), p, EOS2) == r"stop string '\n'"
    assert stop_cause(done("abort", []), p, EOS2) == "abort"
    model = SimpleNamespace(config=EOS2)  # a model works as well as its config
    assert stop_cause(done("stop", [2]), p, model) == "EOS (id 2)"
    with pytest.raises(ValueError, match="not finished"):
        stop_cause(done(None, [4]), p, EOS2)
    with pytest.raises(ValueError, match="these its params"):
        stop_cause(done("stop", [4, 5]), p, EOS2)
    ignoring = SamplingParams(ignore_eos=True, stop=["x"])
    with pytest.raises(ValueError, match="not EOS"):  # EOS does not stop it then
        stop_cause(done("stop", [4, 2]), ignoring, EOS2)


def test_stop_cause_of_the_engine(llama):
    """The engine's own answers: a length cut, EOS, a stop id."""
    _, model = llama
    eos = model.config.eos_token_ids[0]
    llm = LLM(model, max_num_seqs=4, max_model_len=64)
    free = SamplingParams(temperature=0, max_tokens=12)
    ids = llm.generate([[1, 5, 9]], free, use_tqdm=False)[0].outputs[0].token_ids
    params = [free, SamplingParams(temperature=0, max_tokens=12,
                                   stop_token_ids=[ids[2]])]
    outs = [o.outputs[0] for o in llm.generate([[1, 5, 9]] * 2, params, use_tqdm=False)]
    causes = [stop_cause(o, p, model) for o, p in zip(outs, params)]
    want = f"EOS (id {eos})" if ids[-1] == eos else "max_tokens=12"
    assert causes[0] == want
    assert causes[1] == f"stop id {ids[2]}" and len(outs[1].token_ids) <= 3


def test_answer_loss_is_the_mean_cross_entropy(llama):
    _, model = llama
    prompt, answer = [1, 5, 9], [14, 22, 30]
    x = torch.tensor([prompt + answer])
    with torch.inference_mode():
        logits = model(x, torch.arange(6)[None])[0]
    want = torch.nn.functional.cross_entropy(logits[2:5], x[0, 3:]).item()
    assert answer_loss(model, prompt, answer) == pytest.approx(want, rel=1e-5)
    for args, match in [(([], [2]), "non-empty"), (([1], []), "non-empty"),
                        (([1], [10**6]), "ints in"), (([1.5], [2]), "ints in")]:
        with pytest.raises(ValueError, match=match):
            answer_loss(model, *args)


# ChatML's layout, with the bundled tokenizer's specials as its markers
CHATML = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
CHAT = [{"role": "user", "content": "Where is the king?"}]


@pytest.fixture(scope="module")
def chat_tok():
    tok = Tokenizer.from_pretrained(bundled_model_path())
    tok.chat_template = CHATML
    return tok


def test_chat_prompt_problems_passes_the_template(chat_tok):
    ids = chat_tok.apply_chat_template(CHAT, add_generation_prompt=True)
    text = chat_tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                        tokenize=False)
    assert chat_prompt_problems(chat_tok, ids) == []
    assert chat_prompt_problems(chat_tok, text) == []
    two = CHAT + [{"role": "assistant", "content": "Gone."}, CHAT[0]]
    assert chat_prompt_problems(
        chat_tok, chat_tok.apply_chat_template(two, add_generation_prompt=True)) == []


@pytest.mark.parametrize("make, match", [
    (lambda t: t.encode("Where is the king?"), "none of the chat template's markers"),
    (lambda t: "Where is the king?", "it is bare text"),
    (lambda t: t.apply_chat_template(CHAT), "add_generation_prompt=True"),
    (lambda t: t.apply_chat_template(CHAT, add_generation_prompt=True)[:-2],
     "does not end as the chat template"),
    (lambda t: t.encode(t.apply_chat_template(CHAT, add_generation_prompt=True,
                                              tokenize=False)), "BOS twice"),
    (lambda t: t.encode(t.apply_chat_template(CHAT, add_generation_prompt=True,
                                              tokenize=False),
                        add_special_tokens=False, parse_special=False), "plain text")])
def test_chat_prompt_problems_finds_each_problem(chat_tok, make, match):
    problems = chat_prompt_problems(chat_tok, make(chat_tok))
    assert len(problems) == 1 and match in problems[0]


def test_chat_prompt_problems_without_markers_or_template(chat_tok):
    play = Tokenizer.from_pretrained(bundled_model_path())
    assert "no chat template" in chat_prompt_problems(play, "KING HENRY:\n")[0]
    play.chat_template = ("{% for m in messages %}MACDUFF:\n{{ m['content'] }}\n\n"
                          "{% endfor %}"
                          "{% if add_generation_prompt %}ROSS:\n{% endif %}")
    good = play.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat_prompt_problems(play, good) == []
    bare = chat_prompt_problems(play, "Where is the king?")  # no markers to look for
    assert len(bare) == 1 and "does not end as" in bare[0]
    assert "add_generation_prompt" in chat_prompt_problems(
        play, play.apply_chat_template(CHAT))[0]
    dropped = Tokenizer.from_pretrained(bundled_model_path())
    dropped.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="content"):
        chat_prompt_problems(dropped, "x")


def test_chat_prompt_problems_reads_a_transformers_tokenizer(chat_tok):
    hf_tok = transformers.AutoTokenizer.from_pretrained(bundled_model_path())
    hf_tok.chat_template = CHATML
    prompts = {
        "templated": chat_tok.apply_chat_template(CHAT, add_generation_prompt=True),
        "no opening": chat_tok.apply_chat_template(CHAT),
        "bare": chat_tok.encode("Where is the king?")}
    assert prompts["templated"] == list(hf_tok.apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=False))  # the same ids
    verdicts = {name: chat_prompt_problems(chat_tok, ids)
                for name, ids in prompts.items()}
    assert verdicts["templated"] == []
    assert verdicts["no opening"] and verdicts["bare"]
    for name, ids in prompts.items():  # the same verdicts from transformers' tokenizer
        assert chat_prompt_problems(hf_tok, ids) == verdicts[name]
