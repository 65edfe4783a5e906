"""The one progress-bar style: label, bar, done/total, extra columns, time left; gone when done."""

from __future__ import annotations

from typing import Any


def counting_bar(label: str, enabled: bool, *extra: Any):
    """A transient rich Progress (disabled when not `enabled`); `extra` columns go before time left."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        *extra,
        TimeRemainingColumn(),
        disable=not enabled,
        transient=True,
    )
