"""How a context-parallel prefill splits a prompt over its ranks: zigzag, block aligned.

[0, n) is cut into 2N chunks of c tokens, c = ceil(n / 2N) rounded up to a multiple of the block
size (so every boundary is a multiple of it; the last chunks may be shorter or empty). Rank r takes
chunk r and chunk 2N-1-r: under a causal mask an early chunk is cheap and a late one dear, so every
rank gets about the same work. Rank 0 (the owner) holds the last chunk, where the prompt's last
token is whenever that chunk is not empty (a long prompt's always is)."""

from __future__ import annotations

Pieces = tuple[tuple[int, int], ...]  # one rank's position ranges [start, end), in order


def zigzag(n: int, N: int, block_size: int) -> tuple[Pieces, ...]:
    """Per rank (N of them) its pieces of a prompt of ``n`` tokens; empty pieces are dropped."""
    if n < 0 or N < 1 or block_size < 1:
        raise ValueError(f"zigzag needs n >= 0, N >= 1 and block_size >= 1 (got {n}, {N}, {block_size})")
    c = -(-n // (2 * N))
    c = -(-c // block_size) * block_size
    bounds = [min(i * c, n) for i in range(2 * N + 1)]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(2 * N)]
    return tuple(tuple(p for p in (chunks[r], chunks[2 * N - 1 - r]) if p[1] > p[0]) for r in range(N))

