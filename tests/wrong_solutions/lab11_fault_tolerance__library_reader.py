# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The library's code called:
# parlab's checkpoint Reader assembles the tensor (Reader.full: every box piece put in its place), on a Reader whose
# metadata is the tensor's entry and whose pieces come whole through the check's read(); the box is cut out of it.
# The values are right; the guard sees the calls into parlab/schemes/faults/checkpoint.py and the FAIL line names
# them (and whole pieces are read).
# EXPECT FAIL: reshard

# ANSWER: reshard
from parlab.schemes.faults import checkpoint as ckpt


def reshard(pieces, shape, box, read):
    entry = [
        {"rank": p["rank"], "offsets": [a for a, _ in p["box"]], "lengths": [b - a for a, b in p["box"]]}
        for p in pieces
    ]
    reader = ckpt.Reader.__new__(ckpt.Reader)
    reader.meta = {"tensors": {"t": {"shape": shape, "dtype": "float64", "pieces": entry}}}
    reader.files, reader.bytes_read = {}, 0
    sizes = {p["rank"]: p["lengths"] for p in entry}
    reader._piece = lambda rank, name: read(rank, 0, math.prod(sizes[rank])).view(sizes[rank])
    return reader.full("t")[tuple(slice(a, b) for a, b in box)].clone()
