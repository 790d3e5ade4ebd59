# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The library's code
# called: parlab's checkpoint Reader does the reading (Reader.flat: the overlap of a range of the flattened tensor
# with every saved piece), one call per range of the box (the whole box for rows, one per row for columns), on a
# Reader whose metadata is the tensor's entry and whose pieces read through the check's read() only the elements
# sliced out of them. Every number and every read is right; the guard sees the calls into
# parlab/schemes/faults/checkpoint.py and the FAIL line names them.
# EXPECT FAIL: reshard

# ANSWER: reshard
from parlab.schemes.faults import checkpoint as ckpt


class _Piece:
    """Rank q's piece, read lazily: slicing it reads exactly that range."""

    def __init__(self, read, q, start):
        self.read, self.q, self.start = read, q, start

    def __getitem__(self, s):
        return self.read(self.q, self.start + s.start, self.start + s.stop)


def reshard(pieces, shape, box, read):
    reader = ckpt.Reader.__new__(ckpt.Reader)
    reader.meta = {"tensors": {"t": {"shape": shape, "dtype": "float64", "pieces": pieces}}}
    reader.files, reader.bytes_read = {}, 0
    starts = {p["rank"]: p["flat"][0] for p in pieces}
    reader._piece = lambda rank, name: _Piece(read, rank, starts[rank])
    if len(shape) == 1:
        return reader.flat("t", *box[0])
    (r0, r1), (c0, c1) = box
    C = shape[1]
    if (c0, c1) == (0, C):
        return reader.flat("t", r0 * C, r1 * C).view(r1 - r0, C)
    return torch.stack([reader.flat("t", i * C + c0, i * C + c1) for i in range(r0, r1)])
