# ruff: noqa
# A wrong answer to labs/lab04_ring_attention.ipynb: the library's ring pieces, pasted in by import. The ring step
# passes the block on with parlab.schemes.sequence.ring_attention's _pass_on and merges with its merge_partials; the
# numbers, the traffic, the tiles and the overlap are all right, but the part asks for the student's own ring, and
# the check names the library calls.
# EXPECT FAIL: ring

# ANSWER: ring_step
from parlab.schemes.sequence.ring_attention import _pass_on, merge_partials


def ring_step(q, k, v, out, lse):
    incoming, works = _pass_on(torch.stack([k, v]), None, "")
    group = q.shape[1] // k.shape[1]
    o, block_lse = attend(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    out, lse = (o, block_lse) if out is None else merge_partials(out, lse, o, block_lse)
    comm.wait_all(works)
    return out, lse, incoming[0], incoming[1]
