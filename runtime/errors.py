"""Errors the runtime raises for user-facing problems with a model or artifact."""

from __future__ import annotations


class ArtifactError(Exception):
    """A model folder or artifact that cannot be loaded as it is (missing, corrupt, unsupported).

    The message names the bad file, key or value and says how to fix it.
    """


class RequestError(ValueError):
    """A request the engine cannot serve as sent (prompt too long, empty prompt, bad parameter).

    `field` names the offending request field, so the HTTP layer can answer 400 with an
    OpenAI-style error body; the message says what is wrong and the allowed range.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a bug or device failure); requests cannot be served any more."""
