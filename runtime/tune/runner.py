"""The real `measure` of `runtime tune`: one `runtime serve` per setting, benchmark runs against it.

`BenchMeasure(setting, rate, num_prompts)` runs the first `num_prompts` requests of the workload
(runtime/bench/workload.py) at a Poisson `rate` against a server with that setting and scores
them with the benchmark's own `compute_metrics` (runtime/bench/driver.py sends them), adding
`attainment`: the fraction of the requests sent (failed ones count as missed) that met every
SLO term. The server is restarted only when the setting changes, so the search
(runtime/tune/search.py), which evaluates one setting at a time, starts one server per setting
per round. Each server is started as `runtime serve --config FILE` from a file written by
`write_serve_config` (runtime/serve_config.py), the same writer that produces the tuned file,
so every measurement also exercises the file the user will serve with. The file's keys and the
command line come from serve's option table (runtime/serve_options.py: `file_options`,
`serve_argv`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from slimserve.runtime.bench.driver import (
    WARMUP_TOKENS,
    BenchArgs,
    reset_prefix_cache,
    run_requests,
    served_model_name,
    warm_up,
)
from slimserve.runtime.bench.workload import BenchRequest, compute_metrics, poisson_arrivals
from slimserve.runtime.serve_config import write_serve_config
from slimserve.runtime.serve_options import file_options, serve_argv
from slimserve.runtime.server.process import free_port, launched_server, serve_cmd
from slimserve.runtime.server.trust import INTERNAL_KEY_ENV, new_internal_key
from slimserve.runtime.tune.search import Setting

WARM_BATCH = 48  # untimed requests (at most) sent at once to each new server


def serve_options(model: str, base: dict[str, Any], setting: Setting) -> dict[str, Any]:
    """The serve options of one setting: the model, the options every run shares (device,
    KV-cache memory, ...) and the setting's own."""
    return {"model": model, **{k: v for k, v in base.items() if v is not None}, **setting.flags()}


def local_model(model: str) -> str:
    """An existing local path made absolute (the config file may be read from anywhere)."""
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else model


class BenchMeasure:
    """measure(setting, rate, num_prompts) -> metrics, against servers it starts and stops."""

    def __init__(
        self,
        args: BenchArgs,
        requests: list[BenchRequest],
        base: dict[str, Any],
        workdir: Path,
        on_server: Callable[[Setting], None] | None = None,
    ) -> None:
        self.args, self.requests, self.base, self.workdir = args, requests, base, Path(workdir)
        self.on_server = on_server
        self.setting: Setting | None = None
        self.url: str | None = None
        self.internal_key: str | None = None  # the running server's (runtime/server/trust.py)
        self.model_name: str | None = None
        self.server_starts = 0
        self.server_start_s = 0.0  # total s spent starting servers (load + warm-up)
        self._stack = ExitStack()

    def __enter__(self) -> BenchMeasure:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self.setting = self.url = None

    def _start(self, setting: Setting) -> None:
        self.close()
        self._stack = ExitStack()
        if self.on_server is not None:
            self.on_server(setting)
        t0 = time.perf_counter()
        self.server_starts += 1
        name = f"server-{self.server_starts:03d}"
        config = write_serve_config(
            self.workdir / f"{name}.yaml",
            serve_options(local_model(str(self.args.model)), self.base, setting),
            comment=f"runtime tune: {setting.label}",
            options=file_options(),
        )
        port = free_port()
        cmd = serve_cmd(serve_argv({"config": str(config), "host": "127.0.0.1", "port": port}))
        self.internal_key = new_internal_key()  # its admin key (prefix-cache resets), in its env
        self.url = self._stack.enter_context(
            launched_server(
                cmd,
                f"http://127.0.0.1:{port}",
                self.args.server_start_timeout_s,
                self.workdir / f"{name}.log",
                {**os.environ, INTERNAL_KEY_ENV: self.internal_key},
            )
        )
        self.setting = setting
        self.model_name = served_model_name(self.url, self.args)
        if self.args.warmup_requests:
            warm_up(self.url, self.model_name, self.requests, self.args)  # fails loudly
            self._warm_batch()
        self.server_start_s += time.perf_counter() - t0

    def _warm_batch(self) -> None:
        """Untimed: the first WARM_BATCH requests of the workload at once, outputs cut short, so
        that the server has run batches of the workload's shapes before its first timed run
        (each timed run then starts from an empty prefix cache: `__call__`)."""
        reqs = [
            replace(r, output_len=min(r.output_len, WARMUP_TOKENS))
            for r in self.requests[:WARM_BATCH]
        ]
        asyncio.run(
            run_requests(
                self.url,
                self.model_name,
                reqs,
                [0.0] * len(reqs),
                text_prompts=self.args.text_prompts,
                timeout_s=self.args.request_timeout_s,
                api_key=self.args.api_key,
            )
        )

    def __call__(self, setting: Setting, rate: float, num_prompts: int) -> dict[str, Any]:
        if setting != self.setting:
            self._start(setting)
        reqs = self.requests[:num_prompts]
        arrivals = poisson_arrivals(len(reqs), rate, self.args.seed)
        # every run sends the same prompts: without a reset, all but the first run of a server
        # would find them cached and measure no prefill
        reset_prefix_cache(self.url, self.args.api_key, self.internal_key)
        results, duration = asyncio.run(
            run_requests(
                self.url,
                self.model_name,
                reqs,
                arrivals,
                max_concurrency=self.args.max_concurrency,
                text_prompts=self.args.text_prompts,
                timeout_s=self.args.request_timeout_s,
                api_key=self.args.api_key,
            )
        )
        m = compute_metrics(results, duration, self.args.slo_ttft_ms, self.args.slo_tpot_ms)
        m["attainment"] = (m["slo_met"] or 0) / max(len(results), 1)
        return m
