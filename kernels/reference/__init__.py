"""Torch references of the Triton kernels, one module per kernel, named after the
kernels/triton/ module it mirrors; no Triton import.  They are the kernels' test
oracles and the CPU path of the rank programs."""
