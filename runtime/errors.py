"""Errors the runtime raises for user-facing problems with a model or artifact."""

from __future__ import annotations


class ArtifactError(Exception):
    """A model folder or artifact that cannot be loaded as it is (missing, corrupt, unsupported).

    The message names the bad file, key or value and says how to fix it.
    """
