"""Reading server-sent events as the API server writes them (``event:`` names, JSON ``data:``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def named_events(lines: Iterable[str]) -> Iterator[tuple[str | None, Any]]:
    """(event name or None, decoded data) of each event, up to ``data: [DONE]``."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line == "data: [DONE]":
            return
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = None
