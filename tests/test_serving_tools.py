"""Tool calling on /v1/chat/completions: the hermes parser on text, the response and stream shapes
of tool calls, the tool_choice rules, and a round trip with the openai client on a chat template
that declares tools (a random model writes no tool call, so there a test parser makes its output one)."""

import json
from dataclasses import dataclass

import httpx
import openai
import pytest

from afdserve.config import EngineConfig
from afdserve.engine.sampling_params import SamplingParams
from afdserve.serving.chat import ChatTemplate
from afdserve.serving.errors import ApiError
from afdserve.serving.protocol import ChatCompletionRequest
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app
from afdserve.serving.tool_parsers import TOOL_PARSERS, HermesToolParser, ToolCall, register_tool_parser
from afdserve.serving.tools import ToolConfig, ToolPlan, plan_tools, tool_call_schema
from tiny_models import TOOL_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"type": "string"}}}}}


# ---- the hermes parser on text ---------------------------------------------------------------

def _hermes(text, step=None):
    p = HermesToolParser()
    pieces = []
    for i in range(0, len(text), step or len(text) or 1):
        pieces += p.feed(text[i:i + (step or len(text))])
    pieces += p.finish()
    content = "".join(x for x in pieces if isinstance(x, str))
    return content, [(c.name, json.loads(c.arguments)) for c in pieces if isinstance(c, ToolCall)]


HERMES = [
    ("no call at all, a < and a <tool", "no call at all, a < and a <tool", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.<tool_call>{"name": "a", "arguments": {}}</tool_call>'
     '<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}</tool_call>after', "Let me look.after",
     [("a", {}), ("b", {"x": [1, 2]})]),
    ('<tool_call>{"name": "a", "parameters": {"k": "v"}}</tool_call>', "", [("a", {"k": "v"})]),
    ('<tool_call>not json</tool_call> tail', "<tool_call>not json</tool_call> tail", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('x<tool_call>{"name": "a", "arguments": {"q": 1}}', "x", [("a", {"q": 1})]),  # cut before the end tag
    ('x<tool_call>{"name": "a", "argu', 'x<tool_call>{"name": "a", "argu', []),  # cut inside the JSON
]


@pytest.mark.parametrize("text,content,calls", HERMES)
@pytest.mark.parametrize("step", [None, 1, 3])
def test_hermes_parser(text, content, calls, step):
    assert _hermes(text, step) == (content, calls)


def test_hermes_holds_back_a_possible_start_tag():
    p = HermesToolParser()
    assert p.feed("abc <tool") == ["abc "]
    assert p.feed("_c") == []
    assert p.feed("all>") == []
    [call] = p.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert call.name == "f" and call.arguments == "{}" and call.id.startswith("call_")
    assert p.feed("<to") == [] and p.finish() == ["<to"]


# ---- responses and streams -----------------------------------------------------------------

def _auto():
    return ToolPlan("auto", [WEATHER], parser=HermesToolParser)


def _choice(text, finish="stop"):
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def _stream(plan, text, finish="stop", step=2):
    reader = plan.stream()
    deltas = []
    for i in range(0, len(text), step):
        deltas += reader.step(text[i:i + step], None)
    deltas += reader.step("", finish)
    return deltas


def _assemble(deltas):
    """What the openai client makes of the deltas: content, tool calls (by index), finish reason."""
    content, calls, finish = "", {}, None
    for d, fin in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", []):
            slot = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = c.get("id") or slot["id"]
            slot["name"] += c.get("function", {}).get("name") or ""
            slot["arguments"] += c.get("function", {}).get("arguments") or ""
        finish = fin or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_tool_call_becomes_tool_calls_streamed_and_not():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    choice = _choice(text)
    _auto().apply(choice, text)
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Sure."
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    for step in (1, 2, 7, len(text)):
        content, calls, finish = _assemble(_stream(_auto(), text, step=step))
        assert (content, finish) == ("Sure.", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
        assert calls[0]["id"].startswith("call_")
    # the call is sent once, whole, when its markup completes
    deltas = _stream(_auto(), text, step=1)
    assert sum(1 for d, _ in deltas if "tool_calls" in d) == 1
    assert deltas[-1][1] == "tool_calls"


def test_auto_without_a_call_leaves_the_text_alone():
    for text in ["plain answer  \n", "a <tool_call>broken</tool_call>", ""]:
        choice = _choice(text, "length")
        _auto().apply(choice, text)
        assert choice == _choice(text, "length")
        assert _assemble(_stream(_auto(), text, "length")) == (text, [], "length")


def test_named_and_required_outputs():
    named = ToolPlan("named", [WEATHER], name="get_weather")
    choice = _choice('{"city": "Oslo"}')
    named.apply(choice, '{"city": "Oslo"}')
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    content, calls, finish = _assemble(_stream(named, '{"city": "Oslo"}'))
    assert (content, finish) == ("", "stop") and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == '{"city": "Oslo"}'

    required = ToolPlan("required", [WEATHER, TIME])
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    choice = _choice(text)
    required.apply(choice, text)
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    content, calls, finish = _assemble(_stream(required, text))
    assert finish == "tool_calls" and [json.loads(c["arguments"]) for c in calls] == [{"city": "Rome"}, {}]
    cut = '[{"name": "get_weather", "param'
    choice = _choice(cut, "length")
    required.apply(choice, cut)
    assert choice == _choice(cut, "length")


def test_tool_call_schema_as_vllm_builds_it():
    s = tool_call_schema([WEATHER, TIME], "required")
    assert s["type"] == "array" and s["minItems"] == 1 and s["$defs"] == {"zone": {"type": "string"}}
    weather, time_ = s["items"]["anyOf"]
    assert weather["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert weather["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert weather["required"] == ["name", "parameters"] and "$defs" not in time_["properties"]["parameters"]
    assert "$defs" in TIME["function"]["parameters"]  # the request's tools are not changed
    named = tool_call_schema([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named == WEATHER["function"]["parameters"]
    assert tool_call_schema([{"type": "function", "function": {"name": "f"}}],
                            {"type": "function", "function": {"name": "f"}}) == {"type": "object", "properties": {}}


def test_required_and_named_constrain_with_structured_outputs():
    plan = ToolPlan("required", [WEATHER], schema=tool_call_schema([WEATHER], "required"))
    params = plan.constrain(SamplingParams(max_tokens=8))
    assert params.structured_outputs.json == plan.schema and params.max_tokens == 8

    @dataclass
    class OldParams:  # a SamplingParams without structured outputs
        max_tokens: int = 8

    with pytest.raises(ApiError, match="needs structured outputs") as e:
        plan.constrain(OldParams())
    assert e.value.status == 400 and e.value.param == "tool_choice"


def _req(**kw):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | kw)


def test_tool_choice_rules():
    tools_tpl, plain_tpl = ChatTemplate(TOOL_TEMPLATE), ChatTemplate(None)
    on = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert tools_tpl.supports_tools and not plain_tpl.supports_tools

    def plan(template, config=on, **kw):
        r = _req(**kw)
        return plan_tools(r.tools, r.tool_choice, template, config)

    assert plan(tools_tpl).mode == "none" and plan(tools_tpl).tools is None
    auto = plan(tools_tpl, tools=[WEATHER])
    assert auto.mode == "auto" and auto.tools[0]["function"]["name"] == "get_weather"
    assert plan(tools_tpl, tools=[WEATHER], tool_choice="none").tools is not None  # shown, not parsed
    assert plan(plain_tpl, tools=[WEATHER], tool_choice="none").tools is None
    named = plan(tools_tpl, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.schema == WEATHER["function"]["parameters"]
    assert plan(tools_tpl, tools=[WEATHER], tool_choice="required").schema["type"] == "array"
    for template, config, kw, words in [
        (plain_tpl, on, {"tools": [WEATHER]}, "does not support tools"),
        (tools_tpl, ToolConfig(), {"tools": [WEATHER]}, "--enable-auto-tool-choice"),
        (tools_tpl, on, {"tool_choice": "auto"}, "only allowed when tools"),
        (tools_tpl, on, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not in tools"),
    ]:
        with pytest.raises(ApiError, match=words) as e:
            plan(template, config, **kw)
        assert e.value.status == 400


def test_server_flags_are_checked():
    from afdserve.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True).check()
    with pytest.raises(ConfigError, match="unknown tool call parser 'nope'.*hermes"):
        ToolConfig(True, "nope").check()
    ToolConfig(True, "hermes").check()


# ---- end to end, with the openai client ------------------------------------------------------

@register_tool_parser("test-always-calls")
class AlwaysCalls:
    """Test parser: whatever the (random) model writes is one get_weather call with it as ``city``."""

    def __init__(self):
        self.text = ""

    def feed(self, text):
        self.text += text
        return []

    def finish(self):
        return [ToolCall("get_weather", json.dumps({"city": self.text}))]


@pytest.fixture(scope="module")
def url(tiny_tool_model):
    opts = ServerOptions(served_model_name="tiny", enable_auto_tool_choice=True, tool_call_parser="test-always-calls")
    server = BackgroundServer(build_app(EngineConfig(model=str(tiny_tool_model), num_kv_blocks=128, max_model_len=1536),
                                        opts))
    yield server.start()
    server.stop()
    TOOL_PARSERS.pop("test-always-calls", None)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tool_call_round_trip_with_the_openai_client(url, client):
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    kw = dict(model="tiny", tools=[WEATHER], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(messages=msgs, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and args["city"]

    # streamed: the same call (the model is greedy), in OpenAI's delta shape
    chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].index == 0 and streamed[0].function.name == "get_weather"
    assert streamed[0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the tool's result goes back; the template renders the call and the result into the prompt
    history = msgs + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(messages=history, **kw | {"tool_choice": "none"})
    assert r2.choices[0].finish_reason == "length" and r2.choices[0].message.tool_calls is None
    assert isinstance(r2.choices[0].message.content, str)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens

    tokens = httpx.post(url + "/tokenize", json={"messages": history, "tools": [WEATHER]}).json()["tokens"]
    assert len(tokens) == r2.usage.prompt_tokens
    prompt = httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '"name": "get_weather"' in prompt and '"description": "weather in a city"' in prompt  # the tools
    call_json = json.dumps({"name": "get_weather", "arguments": args}, ensure_ascii=False)
    assert f"<tool_call>{call_json}</tool_call>" in prompt
    assert f"<|tool|>{call.id}: sunny, 21 C" in prompt and prompt.endswith("<|assistant|>")


def test_tool_errors_over_http(url, tiny_mixtral):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x", "tool_calls": [{"id": "1", "type": "function",
                                                                      "function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ]
    for extra, param in cases:
        r = httpx.post(url + "/v1/chat/completions", json=base | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    server = BackgroundServer(build_app(EngineConfig(model=str(tiny_mixtral), num_kv_blocks=32),
                                        ServerOptions(served_model_name="tiny")))
    with server as plain:  # no chat template that reads tools
        c = openai.OpenAI(base_url=plain + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not support tools"):
            c.chat.completions.create(model="tiny", messages=base["messages"], tools=[WEATHER])
        r = c.chat.completions.create(model="tiny", messages=base["messages"], tools=[WEATHER], tool_choice="none",
                                      max_tokens=2)
        assert r.choices[0].message.tool_calls is None


def test_named_and_required_tool_choice_are_constrained(client):
    """tool_choice named / "required" constrain the output with structured outputs (the random model
    then writes JSON whitespace until max_tokens, but JSON it is)."""
    msgs = [{"role": "user", "content": "weather?"}]
    kw = dict(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=12, temperature=0)
    if not hasattr(SamplingParams(), "structured_outputs"):
        with pytest.raises(openai.BadRequestError, match="needs structured outputs"):
            client.chat.completions.create(tool_choice="required", **kw)
        return
    r = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    assert r.choices[0].message.content is None
    r = client.chat.completions.create(tool_choice="required", **kw)
    assert r.choices[0].message.content.startswith("[")  # cut short by max_tokens: not a complete call yet
