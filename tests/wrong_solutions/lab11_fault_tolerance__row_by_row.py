# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the overlap of the box
# with every piece read one row at a time, the way some of a piece's columns must be read. Each element is read once
# and nothing else, but where the box takes every column of a piece (q, k, v, gate, up under part 2's layout on 2
# ranks; every piece under the row layout) those rows lie end to end in the piece's file: one read takes them all.
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
        for i in range(i0, i1):
            start = (i - sr0) * width + j0 - sc0
            values = read(q, start, start + j1 - j0)
            if out is None:
                out = torch.empty(box[0][1] - box[0][0], box[1][1] - box[1][0], dtype=values.dtype)
            out[i - box[0][0], j0 - box[1][0] : j1 - box[1][0]] = values
    return out
