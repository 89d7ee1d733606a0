"""Which tokens of a sequence each context-parallel rank holds, and which attention blocks
between two chunks are computed.

cp = a · r ranks: groups of `a` consecutive ranks exchange heads by all-to-all (a = 1 for the
ring, a = cp for all-to-all) and the r groups form a ring. The sequence of length s is cut
into 2r chunks of c = s / 2r tokens; ring member g holds chunks g and 2r−1−g (the load-
balanced "zigzag": under a causal mask chunk i attends to i + 1 chunks, so every member's
pair attends to (g + 1) + (2r − g) = 2r + 1 chunks), and inside its all-to-all group rank
i holds the i-th contiguous 1/a of that pair. With r = 1 (all-to-all) the pair is the whole
sequence and rank i holds its i-th contiguous 1/cp. E.g. s = 16, cp = r = 4 (ring)::

    chunk    0   1   2   3   4   5   6   7        (2 tokens each)
    rank     0   1   2   3   3   2   1   0
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Block", "block_kind", "positions", "ring_chunks"]


def ring_chunks(ring: int, member: int) -> tuple[int, int]:
    """The two chunks (of 2·ring) held by ring member `member`: (member, 2·ring − 1 − member)."""
    return member, 2 * ring - 1 - member


def positions(seq_len: int, ring: int, member: int, a2a: int = 1, a2a_rank: int = 0) -> torch.Tensor:
    """The positions (int64, ascending within each chunk) of the tokens this rank holds:
    the `a2a_rank`-th contiguous 1/a2a of ring member `member`'s two chunks."""
    if seq_len % (2 * ring) or (seq_len // ring) % a2a:
        raise ValueError(
            f"sequence length {seq_len} does not split into 2·{ring} ring chunks shared by {a2a} all-to-all ranks"
        )
    c = seq_len // (2 * ring)
    pair = torch.cat([torch.arange(k * c, (k + 1) * c) for k in ring_chunks(ring, member)])
    piece = pair.numel() // a2a
    return pair[a2a_rank * piece : (a2a_rank + 1) * piece]


class Block(enum.Enum):
    """How the queries of one chunk attend to the keys of another."""

    SKIP = "skip"  # no query sees any key (above the diagonal, or wholly outside the window)
    FULL = "full"  # every query sees every key
    CAUSAL = "causal"  # the diagonal block: query i sees keys j <= i
    MASKED = "masked"  # some pairs: the window's edge crosses the block (`block_mask`)


def block_kind(q_chunk: int, k_chunk: int, c: int, window: int | None) -> Block:
    """The kind of block (queries of chunk `q_chunk`, keys of chunk `k_chunk`, c tokens each)
    under the causal mask and a sliding window of `window` tokens (query p sees key t when
    0 <= p − t < window; None: no window)."""
    if k_chunk > q_chunk:
        return Block.SKIP
    if window is not None:
        nearest = (q_chunk - k_chunk) * c - (c - 1)  # the smallest p − t over the block
        farthest = (q_chunk - k_chunk) * c + (c - 1)  # the largest
        if nearest >= window:
            return Block.SKIP
        if farthest >= window:
            return Block.MASKED
    return Block.CAUSAL if q_chunk == k_chunk else Block.FULL


def block_mask(q_chunk: int, k_chunk: int, c: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[c, c] bool: which (query, key) pairs of the block are allowed."""
    p = q_chunk * c + torch.arange(c, device=device)[:, None]
    t = k_chunk * c + torch.arange(c, device=device)[None, :]
    allowed = t <= p
    return allowed if window is None else allowed & (p - t < window)
