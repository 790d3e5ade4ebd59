# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: from each piece one read,
# from the first element of the overlap to its last, as they lie in the piece's file. Where the overlap is only some
# of the piece's columns (the column cut's boxes of q, k, v, gate, up, saved by rows), that read takes the columns
# between its rows that the box does not hold.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, box, read):
    out = None
    for piece in pieces:
        q, saved = piece["rank"], piece["box"]
        overlap = [(max(a, sa), min(b, sb)) for (a, b), (sa, sb) in zip(box, saved)]
        if any(a >= b for a, b in overlap):
            continue
        if len(shape) == 1:
            (a, b), (sa, _) = overlap[0], saved[0]
            values = read(q, a - sa, b - sa)
            out = torch.empty(box[0][1] - box[0][0], dtype=values.dtype) if out is None else out
            out[a - box[0][0] : b - box[0][0]] = values
            continue
        (i0, i1), (j0, j1) = overlap
        (sr0, _), (sc0, sc1) = saved
        width = sc1 - sc0
        first, last = (i0 - sr0) * width + j0 - sc0, (i1 - 1 - sr0) * width + j1 - sc0
        values = read(q, first, last)
        block = torch.cat([values, values.new_zeros(width - (j1 - j0))]).view(i1 - i0, width)[:, : j1 - j0]
        if out is None:
            out = torch.empty(box[0][1] - box[0][0], box[1][1] - box[1][0], dtype=values.dtype)
        out[i0 - box[0][0] : i1 - box[0][0], j0 - box[1][0] : j1 - box[1][0]] = block
    return out
