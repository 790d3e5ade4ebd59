# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the library's flat view of
# a checkpoint (a piece is a range of the flattened tensor): the box's runs computed in the whole tensor's flattened
# order, each read at that run's offset from the piece's first element in the tensor. A piece that is a box of
# whole rows (q, k, v, gate, up, the embedding, the head, the gains) is read right; a piece of columns (o, down) is
# not stored as the tensor's flattened range: its rank's file holds other elements there.
# EXPECT FAIL: reshard

# ANSWER: reshard
def reshard(pieces, shape, box, read):
    C = shape[1] if len(shape) == 2 else 1
    cols = box[1] if len(shape) == 2 else (0, 1)
    flat = lambda i, j: i * C + j
    out = []
    for i in range(*box[0]):
        for piece in pieces:
            saved = piece["box"]
            scols = saved[1] if len(shape) == 2 else (0, 1)
            if not saved[0][0] <= i < saved[0][1]:
                continue
            a, b = max(cols[0], scols[0]), min(cols[1], scols[1])
            if a >= b:
                continue
            origin = flat(saved[0][0], scols[0])
            out.append(read(piece["rank"], flat(i, a) - origin, flat(i, b) - origin))
    return torch.cat(out).view([b - a for a, b in box])
