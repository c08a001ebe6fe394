"""How a prompt's positions are split over the ranks of a context-parallel (CP) prefill."""

from __future__ import annotations

Piece = tuple[int, int]  # positions [start, end)


def zigzag(n: int, N: int, block_size: int) -> tuple[tuple[Piece, ...], ...]:
    """The pieces of a prompt of ``n`` tokens split over ``N`` ranks, per rank (rank 0 first).

    ``[0, n)`` is cut into chunks of ``c`` positions, ``c`` = ceil(n / (2 N)) rounded up to a multiple
    of ``block_size`` (every boundary a block boundary): ``K`` = ceil(n / c) <= 2 N non-empty chunks,
    the last one possibly shorter. Rank ``r`` takes chunks ``r`` and ``K - 1 - r`` (once where they
    are the same chunk; none where ``r > K - 1 - r``), so the causal work is balanced and rank 0 (the
    owner) holds the last chunk, whose last token samples the first output token. With ``K = 2 N``
    (the rounding leaves no chunk empty) rank ``r`` holds chunks ``r`` and ``2 N - 1 - r``. A rank's
    pieces are in increasing position order; a rank may hold none when ``n`` is small.

    ``zigzag(10, 2, 2)``: c = 4, chunks [0, 4), [4, 8), [8, 10): ``(((0, 4), (8, 10)), ((4, 8),))``.
    """
    for name, value in (("n", n), ("N", N), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"zigzag: {name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"zigzag: {name} must be at least 1, got {value}")
    per = -(-n // (2 * N))
    c = -(-per // block_size) * block_size
    k = -(-n // c)

    def chunk(i: int) -> Piece:
        return i * c, min((i + 1) * c, n)

    return tuple(() if r > k - 1 - r else tuple(chunk(i) for i in sorted({r, k - 1 - r})) for r in range(N))
