"""ZeRO: data parallelism without N copies of the training state.

stages.py   the flat, padded layout and stages 1, 2, 3 (+ mixed precision), with Adam on the shards
theory.py   the paper's formulas (memory per stage, bytes on the wire, offload placements); torch-free
offload.py  ZeRO-Offload (Adam's state in host memory) and ZeRO-Infinity (on disk)
"""
