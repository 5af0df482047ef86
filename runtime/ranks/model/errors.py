"""The model package's refusals: each names the field or tensor at fault."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A model config is missing a field, holds a bad value, or asks for something
    unsupported (architecture, RoPE scaling type, tensor-parallel split)."""


class LoadError(RuntimeError):
    """A checkpoint does not match the model: a tensor is missing, unexpected, or
    has the wrong shape. The message names the tensor."""
