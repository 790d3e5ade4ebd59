"""Sequence parallelism: split the activations along the sequence, because long sequences break memory.

sequence_parallel.py   the three ways side by side: Megatron SP on tensor parallelism, and the GPT with its
                       sequence split (Ulysses or ring attention), their training loop and their theory
ulysses.py             DeepSpeed-Ulysses: two all-to-alls trade the sequence split for a head split
ring_attention.py      Ring Attention: K/V blocks passed round a ring, contiguous or zigzag layout
usp.py                 USP: Ulysses inside, ring attention across, on a 2-D mesh
"""
