"""Loads a model folder's tokenizer.json and its special tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from afdserve.errors import ModelError


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    eos_token_ids: set[int] = field(default_factory=set)
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): other threads go on
        return self.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _token_str(v: object) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def load_tokenizer(path: str | Path, model_eos: tuple[int, ...] = ()) -> TokenizerInfo:
    path = Path(path)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelError(f"{path}: no tokenizer.json")
    tok = Tokenizer.from_file(str(tj))
    cfg: dict = {}
    if (path / "tokenizer_config.json").is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    info = TokenizerInfo(tok, set(model_eos), _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")),
                         cfg.get("chat_template"))
    if info.eos_token and tok.token_to_id(info.eos_token) is not None:
        info.eos_token_ids.add(tok.token_to_id(info.eos_token))
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        info.eos_token_ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    return info
