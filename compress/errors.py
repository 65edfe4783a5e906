"""User-facing error types of `compress`; the CLI turns them into one line and exit code 2."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe that cannot run: bad key, bad value, missing file. The message names the fix."""


class UnsupportedModelError(ValueError):
    """A model the requested stage cannot handle (architecture, shapes)."""
