"""Hybrid parallelism: any set of dp, pp, cp, tp (and ep) on one device mesh, each scheme on its own axis.

train.py     check_parallel_dims (every invalid combination named), the axes' groups, train_hybrid, theory
stage.py     the pieces train.py composes: one pipeline stage with TP (+ SP) and CP inside, ZeRO per micro-batch
experts.py   experts (ep) and USP on the mesh: the axes that split another axis' ranks
planner.py   which DP x TP x PP x CP (+ SP, ZeRO, offload, experts) fits a cluster, and how fast; torch-free
"""
