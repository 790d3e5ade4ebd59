"""Activation recomputation (Korthikanti et al. 2022): keep fewer activations, recompute the rest in the backward.

measure.py   the reference GPT's activations and FLOPs measured per mode (none, selective, full)
theory.py    the paper's formulas, term by term, adapted to the reference GPT; torch-free (the planner uses it)
"""
