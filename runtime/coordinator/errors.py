"""The scheduler's refusals: each leaves state unchanged."""

from __future__ import annotations


class SchedulerError(RuntimeError):
    """Base class of the scheduler's refusals."""


class CommitError(SchedulerError):
    """A plan can no longer be committed as it stands; nothing changed."""


class CompletionError(SchedulerError):
    """A completion is malformed or out of order; nothing changed."""


class PublicationError(SchedulerError):
    """A publication names output never produced or already published; nothing changed."""
