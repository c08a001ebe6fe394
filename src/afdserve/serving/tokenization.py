"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them: a prompt -- or chat messages,
rendered with the chat template as ``/v1/chat/completions`` renders them -- to token ids, and token
ids back to text (special tokens included, so that ids -> text -> ids round-trips). Tokenizing runs
in a worker thread, with ``encode`` (which lets the event loop run meanwhile): a long input does not
hold up other requests."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, Tag

from afdserve.engine.tokenizer import TokenizerInfo
from afdserve.errors import RequestError
from afdserve.serving.async_engine import AsyncEngine
from afdserve.serving.chat import ChatTemplate, template_messages
from afdserve.serving.errors import ApiError
from afdserve.serving.protocol import ChatMessage, ChatTool, TokenId, _Strict


def encode(tok: TokenizerInfo, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids. The tokenizers library's ``encode`` holds the GIL for the whole text
    (seconds for megabytes: every other thread stops); ``encode_batch`` releases it."""
    return tok.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS)")
    return_token_strs: bool | None = Field(False, description="also return each token as a string")


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    add_generation_prompt: bool = Field(True, description="end with the template's assistant prompt")
    add_special_tokens: bool = Field(False, description="add special tokens on top of the template's own")
    return_token_strs: bool | None = Field(False, description="also return each token as a string")


def _kind(body: Any) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


#: A prompt or chat messages (told apart by ``messages``, so that errors name the right fields).
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
                            | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")], Discriminator(_kind)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: ChatTemplate):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        tok = self._tokenizer(req.model)
        if isinstance(req, TokenizeChatRequest) and req.tools and not self.chat_template.supports_tools:
            raise ApiError(400, "this model's chat template does not support tools (it never uses `tools`)",
                           param="tools", code="unsupported_parameter")

        def run() -> tuple[list[int], list[str] | None]:
            text = self._render(req) if isinstance(req, TokenizeChatRequest) else req.prompt
            ids = encode(tok, text, req.add_special_tokens)
            strs = [tok.tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
            return ids, strs

        ids, strs = await asyncio.to_thread(run)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        tok = self._tokenizer(req.model)
        vocab = self.engine.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of the vocabulary (ids are in [0, {vocab}))",
                           param="tokens", code="invalid_value")
        text = await asyncio.to_thread(  # decode_batch releases the GIL (decode holds it)
            lambda: tok.tokenizer.decode_batch([req.tokens], skip_special_tokens=False)[0])
        return DetokenizeResponse(prompt=text)

    def _tokenizer(self, model: str | None) -> TokenizerInfo:
        if model is not None and model != self.model_name:
            raise ApiError(400, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")
        tok = self.engine.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer", code="unsupported_value")
        return tok

    def _render(self, req: TokenizeChatRequest) -> str:
        tools: list[dict[str, Any]] | None = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            return self.chat_template.render(template_messages(req.messages), tools, req.add_generation_prompt)
        except RequestError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from e
