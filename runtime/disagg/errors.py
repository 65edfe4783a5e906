"""Errors of a KV hand-over; each message names the bad value and the fix."""

from __future__ import annotations


class KVTransferError(Exception):
    """A KV hand-over failed; `status` is the HTTP status a server answers it with."""

    status = 500
    code = "kv_transfer_failed"


class KVHandleError(KVTransferError):
    """The handle sent with a request is malformed (not from a slimserve prefill replica)."""

    status = 400
    code = "bad_kv_handle"


class KVSegmentMissing(KVTransferError):
    """The segment is gone: imported already, expired, or written on another host."""

    status = 410
    code = "kv_segment_missing"


class KVLayoutError(KVTransferError):
    """The two sides' KV layouts differ: importing would give garbage, so it is refused."""

    status = 409
    code = "kv_layout_mismatch"


class KVStoreFull(KVTransferError):
    """The server holds as many KV segments (or bytes of them) as it allows: retry shortly."""

    status = 503
    code = "kv_store_full"
