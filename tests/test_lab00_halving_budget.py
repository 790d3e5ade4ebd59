"""Lab 00, part 5: the byte budget of the busiest rank holds for every P and N, not only for the sizes the check runs.

Fold-in/fold-out designs are simulated (bytes only, no ranks): blocks of elements cut in halves (rounded either
way, as the solution does one of them), the extras folded into the lowest or the highest places. The busiest rank
of each must stay within halving_bytes(P, N) for P <= 32 and N <= 300. A design with blocks of whole chunks
(x.tensor_split(P')) is checked on the sizes the check runs.
"""

import pytest

from parlab.grading.labs.lab00_ring_allreduce import HALVING_CASES, _sizes, halving_bytes


def _busiest(P: int, N: int, blocks: str, fold: str, up: bool) -> int:
    """Elements the busiest rank sends. blocks: "elements" (a block cut in halves, the larger half the lower one if
    `up`) or "chunks" (blocks of whole chunks); fold: which ranks inside take the extras' x."""
    Q = 1 << (P.bit_length() - 1)
    takes = {(e - Q if fold == "low" else Q - 1 - (e - Q)) for e in range(Q, P)}
    chunks = _sizes(N, Q)
    sent = dict.fromkeys(range(Q, P), N)
    for r in range(Q):
        lo, hi, d, kept, out = 0, Q if blocks == "chunks" else N, Q // 2, [], 0
        while d >= 1:  # halving: send the half it gives away, keep the other
            if blocks == "chunks":
                mid = (lo + hi) // 2
                size = lambda a, b: sum(chunks[a:b])  # noqa: E731
            else:
                mid = lo + ((hi - lo + 1) // 2 if up else (hi - lo) // 2)
                size = lambda a, b: b - a  # noqa: E731
            lo, hi, give = (lo, mid, size(mid, hi)) if r & d == 0 else (mid, hi, size(lo, mid))
            out += give
            kept.append(size(lo, hi))
            d //= 2
        out += sum(kept)  # doubling sends back, step by step, the blocks it kept
        sent[r] = out + (N if r in takes else 0)
    return max(sent.values())


def _budget(P: int, N: int) -> int:
    b = halving_bytes(P, N)
    return (max(b) if isinstance(b, list) else b) // 8


@pytest.mark.parametrize("P", range(2, 33))
def test_busiest_rank_within_the_stated_budget(P):
    for N in range(1, 301):
        for fold in ("low", "top"):
            for up in (True, False):
                assert _busiest(P, N, "elements", fold, up) <= _budget(P, N), (P, N, fold, up)


def test_powers_of_two_send_exactly_the_ring_bytes_when_p_divides_n():
    for P in (2, 4, 8, 16, 32):
        for N in range(P, 301, P):
            assert _busiest(P, N, "elements", "low", False) == _budget(P, N) == 2 * (N - N // P)


def test_whole_chunk_blocks_meet_the_budget_on_the_checked_sizes():
    for P, N in HALVING_CASES:
        assert _busiest(P, N, "chunks", "low", True) <= _budget(P, N), (P, N)


def test_the_rounding_term_is_needed():
    """Without log2 P' the budget fails a textbook design (P = 9, N = 9: the busiest sends 26 > 25)."""
    assert _busiest(9, 9, "elements", "low", True) == 26 > 9 + 2 * (9 - 9 // 8)
