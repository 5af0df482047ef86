"""Compute kernels used by the ranks."""
