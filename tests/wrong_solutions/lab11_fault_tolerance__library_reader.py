# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The library's code
# called: parlab's checkpoint Reader does the reading (Reader.flat: the overlap of a range of the flattened tensor
# with every saved piece), one call per row of the box, on a Reader whose metadata is the tensor's entry and whose
# files are the check's read(). Every number and every read is right; the guard sees the calls into
# parlab/schemes/faults/checkpoint.py and the FAIL line names them.
# EXPECT FAIL: reshard

# ANSWER: reshard
from parlab.schemes.faults import checkpoint as ckpt


def reshard(pieces, shape, box, read):
    reader = ckpt.Reader.__new__(ckpt.Reader)
    reader.meta = {"tensors": {"t": {"shape": shape, "dtype": "float64", "pieces": pieces}}}
    reader.files, reader.bytes_read = {}, 0
    reader._piece = lambda rank, name: read(rank)
    if len(shape) == 1:
        return reader.flat("t", *box[0])
    (r0, r1), (c0, c1) = box
    return torch.stack([reader.flat("t", i * shape[1] + c0, i * shape[1] + c1) for i in range(r0, r1)])
