"""Every error the engine raises to its callers, in one place: the ingress maps them to HTTP statuses."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A model worker died or failed; the engine cannot go on and must be rebuilt."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: the request was refused before it took any resource."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down: new requests are refused while the ones in flight finish."""


def short_reason(error: BaseException) -> str:
    """The last line of an error (Ray puts the remote traceback first): what clients are told; logs keep the rest."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]
