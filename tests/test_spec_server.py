"""Chapter 10 in the server (issue 40): `minillm serve --speculative-config JSON`, as
vLLM's, and vLLM's spec_decode counters on /metrics. The real `openai` client drives
a speculative server of the bundled model: its answers at temperature 0 are those of
an engine without speculation, streamed or not; the counters are there only when the
engine speculates, and they add up; a bad flag is argparse's usage error."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve import NAME, tiny_llm  # noqa: E402

import minillm.speculative.serve  # noqa: E402,F401  registers the flag and the counters
from minillm.sampling import SamplingParams  # noqa: E402
from minillm.serve import cli  # noqa: E402
from minillm.serve.app import build_app  # noqa: E402
from minillm.serve.async_engine import EngineStats  # noqa: E402
from minillm.serve.cli import BackgroundServer  # noqa: E402
from minillm.serve.metrics import ServerMetrics  # noqa: E402
from minillm.utils import bundled_model_path  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
REPEAT = "ROMEO:\nO Romeo, Romeo, wherefore art thou Romeo?\nJULIET:\nO Romeo, Romeo"
CHAT = [{"role": "user", "content": "O Romeo, Romeo, wherefore art thou Romeo? "
         "O Romeo, Romeo, wherefore art thou Romeo?"}]
COUNTERS = ("minillm:spec_decode_num_drafts", "minillm:spec_decode_num_draft_tokens",
            "minillm:spec_decode_num_accepted_tokens",
            "minillm:spec_decode_num_accepted_tokens_per_pos")


@pytest.fixture(scope="module")
def offline():
    """The same model without speculation: what the server must reproduce."""
    return tiny_llm(max_num_seqs=4)


@pytest.fixture(scope="module")
def spec_server():
    llm = tiny_llm(max_num_seqs=4, speculative_config=SPEC)
    with BackgroundServer(build_app(llm, NAME)) as server:
        yield server.url, llm.engine
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished()
    assert engine.kv.blocks.num_free == engine.kv.blocks.num_blocks


@pytest.fixture
def client(spec_server):
    return openai.OpenAI(base_url=spec_server[0] + "/v1", api_key="none",
                         max_retries=0)


def spec_counters(text: str) -> dict:
    """{name: value} of the spec_decode samples; per position: {position: value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("minillm:spec_decode"):
                if "position" in s.labels:
                    out.setdefault(s.name, {})[int(s.labels["position"])] = s.value
                else:
                    out[s.name] = s.value
    return out


def scrape(url: str) -> dict:
    return spec_counters(httpx.get(url + "/metrics").text)


def check_counters(c: dict) -> None:
    """What the four counters must satisfy at any moment."""
    drafts = c["minillm:spec_decode_num_drafts_total"]
    drafted = c["minillm:spec_decode_num_draft_tokens_total"]
    accepted = c["minillm:spec_decode_num_accepted_tokens_total"]
    per_pos = c.get("minillm:spec_decode_num_accepted_tokens_per_pos_total", {})
    assert accepted <= drafted and drafts <= drafted <= 4 * drafts
    assert sum(per_pos.values()) == accepted
    assert sorted(per_pos) == list(range(len(per_pos))) and len(per_pos) <= 4
    values = [per_pos[i] for i in sorted(per_pos)]
    assert values == sorted(values, reverse=True)  # position i+1 needs position i
    assert all(v <= drafts for v in values)


def test_completion_at_temperature_0_is_the_plain_answer(client, offline,
                                                         spec_server):
    url, engine = spec_server
    before = scrape(url)
    params = SamplingParams(temperature=0, max_tokens=40)
    want = offline.generate(REPEAT, params, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=NAME, prompt=REPEAT, max_tokens=40,
                                    temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    after = scrape(url)
    check_counters(after)
    drafted = "minillm:spec_decode_num_draft_tokens_total"
    accepted = "minillm:spec_decode_num_accepted_tokens_total"
    assert after[drafted] > before.get(drafted, 0)  # this request speculated
    assert after[accepted] > before.get(accepted, 0)
    stats = engine.runner.speculator.stats  # the page says what the engine counted
    assert after[accepted] == stats.num_accepted_tokens
    assert after[drafted] == stats.num_draft_tokens
    assert after["minillm:spec_decode_num_drafts_total"] == stats.num_drafts


def test_chat_and_streamed_chat_at_temperature_0(client, offline):
    want = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=30,
                                         temperature=0)
    assert got.choices[0].message.content == want
    chunks = list(client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=30, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_streaming_delivers_accepted_drafts_together(client, offline, spec_server):
    """A step that accepts drafts sends them in one event: fewer events than tokens,
    the same text; /metrics scraped while it streams stays consistent and grows."""
    url = spec_server[0]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = offline.generate(REPEAT, params, use_tqdm=False)[0].outputs[0]
    pieces, seen = [], [scrape(url)]
    for chunk in client.completions.create(
            model=NAME, prompt=REPEAT, max_tokens=60, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            seen.append(scrape(url))
        else:
            usage = chunk.usage
    assert "".join(pieces) == want.text
    assert usage.completion_tokens == len(want.token_ids) == 60
    assert len(pieces) < 60  # some events carried several tokens
    for earlier, later in zip(seen, seen[1:]):
        check_counters(later)
        for name in ("minillm:spec_decode_num_drafts_total",
                     "minillm:spec_decode_num_accepted_tokens_total"):
            assert later[name] >= earlier.get(name, 0)


def test_counters_only_when_the_engine_speculates(offline, spec_server, client):
    client.completions.create(model=NAME, prompt=REPEAT, max_tokens=12, temperature=0)
    plain = ServerMetrics("plain", lambda: EngineStats(), offline.engine).render()
    assert "spec_decode" not in plain.decode()
    assert "spec_decode" not in ServerMetrics("plain", EngineStats).render().decode()
    page = httpx.get(spec_server[0] + "/metrics").text
    for name in COUNTERS:
        assert f"# TYPE {name}_total counter" in page
        assert f'{name}_total{{model_name="{NAME}"' in page
    assert f'{{model_name="{NAME}",position="0"}}' in page


# --- the command line ---------------------------------------------------------------

def parse(*flags: str):
    return cli.parser().parse_args([str(bundled_model_path()), *flags])


def test_the_flag_becomes_llms_speculative_config():
    args = parse("--speculative-config", '{"method": "ngram", '
                 '"num_speculative_tokens": 3}')
    assert cli.engine_args(args)["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 3}
    assert "speculative_config" not in cli.engine_args(parse())  # not given: out


@pytest.mark.parametrize("value, says", [
    ("{method: ngram}", "Expecting property name"),
    ('{"method": "ngram", "num_speculative_tokens": 4', "Expecting"),
    ('["ngram"]', "give a dict"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "k": 2}', "unknown keys ['k']"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method='medusa'"),
])
def test_a_bad_speculative_config_is_a_usage_error(capsys, value, says):
    with pytest.raises(SystemExit) as e:
        parse("--speculative-config", value)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "argument --speculative-config" in err
    assert says in err


def test_main_serves_a_speculative_engine(monkeypatch):
    """`serve MODEL --speculative-config ...` as the command runs it (uvicorn caught):
    the app's engine speculates and its /metrics has the counters."""
    apps = []
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kw: apps.append(app))
    draft = json.dumps({"model": str(bundled_model_path()), "quantization": "int8",
                        "num_speculative_tokens": 2})
    assert cli.main([str(bundled_model_path()), "--max-model-len", "128",
                     "--speculative-config", draft]) == 0
    server = apps[0].state.server
    engine = server.engine.engine
    assert engine.config.options["speculative_config"]["method"] == "draft_model"
    assert engine.runner.speculator.k == 2
    assert set(spec_counters(server.metrics.render().decode())) == {
        "minillm:spec_decode_num_drafts_total",
        "minillm:spec_decode_num_draft_tokens_total",
        "minillm:spec_decode_num_accepted_tokens_total"}  # no position yet
