"""The OpenAI API's request and response bodies (the subset afdserve serves), as pydantic models.

Requests are strict (``"1"`` is not a number, ``true`` is not an integer; an integral float such as
``16.0`` is an integer, as in JSON Schema) and reject unknown fields, like OpenAI's API; afdserve's
extensions are ``top_k``, ``ignore_eos`` and ``return_token_ids``. The models also make the
server's OpenAPI schema (``/openapi.json``), which states what the server accepts: where a rule is
checked in the handler rather than by pydantic (an empty prompt, a ``suffix``, ``stream_options``
without ``stream``), ``json_schema_extra`` says it in the schema; the limits of one deployment
(the model name, the vocabulary, the batch size, the number of experts) are added by ``app.openapi``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from afdserve.config import MAX_POOL_WORKERS


def _integral(v: Any) -> Any:
    """JSON Schema counts 16.0 as an integer: accept integral floats, nothing else."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


INTEGRAL = BeforeValidator(_integral)  # after the constraints, so that they stay in the JSON schema
Float = Annotated[float, Field(allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0), INTEGRAL]
Seed = Annotated[int, INTEGRAL]  # any integer (the engine gets it modulo 2**63)
NonEmpty = Annotated[str, Field(min_length=1)]
Stop = NonEmpty | list[NonEmpty] | None
TOKEN_ID_KEY = r"^(0|[1-9][0-9]*)$"  # a logit_bias key: a token id in decimal


def _not_zero(v: int) -> int:
    if v == 0:
        raise ValueError("top_k must be -1 (all tokens) or >= 1")
    return v


TopK = Annotated[int, Field(ge=-1, json_schema_extra={"not": {"const": 0}}), INTEGRAL, AfterValidator(_not_zero)]


def _needs(field: str, value: Any, *, unless: str) -> dict[str, Any]:
    """JSON schema: ``unless`` may be set (non-null) only when ``field`` is ``value``."""
    return {"anyOf": [{"required": [field], "properties": {field: {"const": value}}},
                      {"properties": {unless: {"type": "null"}}}]}


def _all_of(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"allOf": list(rules)}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


_STREAM_OPTIONS = _needs("stream", True, unless="stream_options")  # checked in generation.py


class StreamOptions(_Strict):
    include_usage: bool = False
    include_progress: bool = Field(False, description="send the prefill's progress as chunks with no choices and "
                                   "a `progress` object, while the prompt is computed")


class JsonSchemaFormat(_Strict):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: str | None = Field(None, description="an EBNF grammar")


class _SamplingFields(_Strict):
    """Fields shared by completion and chat requests."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Float], Field(json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_KEY}})] \
        | None = Field(None, description="token id (decimal) -> bias added to its logit (clamped to [-100, 100])")
    user: str | None = None
    response_format: ResponseFormat | None = None
    # afdserve extensions (as in vLLM)
    top_k: TopK | None = Field(None, description="sample from the k most likely tokens (-1: all)")
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(
        None, description="drop tokens less likely than min_p times the most likely one")
    repetition_penalty: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] | None = Field(
        None, description="divides positive / multiplies negative logits of tokens in the prompt or output")
    min_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = Field(
        None, description="tokens generated before EOS or a stop token id may end the output")
    stop_token_ids: list[TokenId] | None = Field(None, description="token ids that end the output")
    ignore_eos: bool | None = Field(False, description="keep generating after the end-of-sequence token")
    return_token_ids: bool | None = Field(False, description="also return the generated token ids of each choice")
    return_tokens_as_token_ids: bool | None = Field(
        False, description="name tokens in logprobs 'token_id:N' (decoded strings can coincide)")
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="constrain the output (exactly one of json, json_object, regex, choice, grammar)")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name: structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older name: structured_outputs.regex")
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = Field(
        None, description="vLLM's older name: structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM's older name: structured_outputs.grammar")


def _min(n: int, key: str = "minItems") -> Any:
    return Field(json_schema_extra={key: n})  # checked by the handler (its own error code)


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=_STREAM_OPTIONS)
    prompt: Annotated[str, _min(1, "minLength")] | Annotated[list[TokenId], _min(1)] \
        | Annotated[list[Annotated[str, _min(1, "minLength")]], _min(1)] \
        | Annotated[list[Annotated[list[TokenId], _min(1)]], _min(1)] = Field(
        description="a string, a list of token ids, or a batch of either")
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = 16
    echo: bool | None = False
    suffix: Annotated[str, Field(json_schema_extra={"maxLength": 0})] | None = Field(
        None, description="not supported (null or empty)")
    logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    best_of: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(None, description="must equal n (as in vLLM)")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCallParam(_Strict):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    """A message has ``content``; only an assistant message that made tool calls may go without."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"],
         "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="required unless an assistant made tool_calls")
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="assistant: the tool calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers")

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (only an assistant message with tool_calls may have none)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON schema")
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=_all_of(  # checked in generation.py and tools.py
        _STREAM_OPTIONS, _needs("logprobs", True, unless="top_logprobs"), {"anyOf": [
            {"required": ["tools"], "properties": {"tools": {"type": "array"}}},
            {"properties": {"tool_choice": {"type": "null"}}}]}))
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: 'auto' with tools, else 'none'")
    parallel_tool_calls: bool | None = None
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None


# ---- responses -------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "afdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


MAX_SLOTS_PER_WORKER = 4096  # a bound for any model; the server also checks its number of experts


class RebalanceRequest(_Strict):
    """``POST /admin/rebalance``: re-plan the expert placement from the recent load."""

    slots_per_worker: Annotated[int, Field(ge=1, le=MAX_SLOTS_PER_WORKER), INTEGRAL] | None = Field(
        default=None, description="expert slots per expert worker (at most the model's number of experts)")
    planner: Literal["janus", "megascale"] = "janus"


class RebalanceResponse(BaseModel):
    version: int
    experts_per_worker: list[list[list[int]]]  # [worker][layer] -> logical experts held


class ScaleRequest(_Strict):
    """``POST /admin/scale``: resize the attention and/or the expert pool while serving."""

    attention_workers: Annotated[int, Field(ge=1, le=MAX_POOL_WORKERS), INTEGRAL] | None = Field(
        default=None, description="attention workers wanted (unchanged if absent)")
    expert_workers: Annotated[int, Field(ge=1, le=MAX_POOL_WORKERS), INTEGRAL] | None = Field(
        default=None, description="expert workers wanted (unchanged if absent; at most the model's number of experts)")


class ScaleResponse(BaseModel):
    attention_workers: int
    expert_workers: int
    epoch: int  # membership epoch of the resized deployment
    map_version: int  # expert map in use (re-placed when the expert pool changed)
    seconds: float  # until every worker of the new membership was ready
    experts_per_worker: list[list[list[int]]]  # [worker][layer] -> logical experts held
