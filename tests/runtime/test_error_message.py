"""Reading an error answer back (the router relaying a replica's error, the benchmark client
recording a failed request): one helper next to `error_body` (runtime/server/protocol.py)."""

import json

import pytest

from slimserve.runtime.server.protocol import error_body, error_message


@pytest.mark.parametrize(
    "body,want",
    [
        (json.dumps(error_body("prompt too long", param="prompt")).encode(), "prompt too long"),
        (json.dumps({"problem": "engine loop died"}), "engine loop died"),  # /state's 503 answer
        (b"  upstream connect error\n", "upstream connect error"),  # a proxy's plain text
        (
            json.dumps({"error": "flat string"}).encode(),
            '{"error": "flat string"}',
        ),  # not ours: the text
        (json.dumps([1, 2]), "[1, 2]"),
        (b"\xff\xfe bad bytes", "\ufffd\ufffd bad bytes"),
    ],
)
def test_error_message_reads_every_shape_of_answer(body, want):
    assert error_message(body) == want


def test_error_message_cuts_long_text():
    assert error_message("x" * 1000) == "x" * 200 and len(error_message(b"y" * 50, limit=10)) == 10
