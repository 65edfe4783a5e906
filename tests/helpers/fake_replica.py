"""A `runtime serve` stand-in over the fake engine, as its own process, for router tests that
must kill a replica for real: python -m tests.helpers.fake_replica PORT [DELAY_S]."""

from __future__ import annotations

import sys

import uvicorn

from slimserve.runtime.server.app import build_app
from tests.helpers.server_fakes import FakeEngine

if __name__ == "__main__":
    port = int(sys.argv[1])
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    engine = FakeEngine(delay=delay, max_model_len=4096)
    uvicorn.run(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
