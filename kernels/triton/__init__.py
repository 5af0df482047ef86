"""Triton kernels, each with a launcher, a torch reference and a test."""
