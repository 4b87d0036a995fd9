"""Numerics: element formats and named recipes, rounding to a grid, quantizers with statistics,
Hadamard transforms, delayed-scaling histories, the Triton kernels and the custom ops around
them.

May import: lowprec.base (and torch; Triton only inside `kernels/`).
"""
