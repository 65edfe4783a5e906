"""What the ranks say through the TCPStore is signed with the run's secret
(runtime/distributed/signed_store.py): under the `ray` executor the store listens on the node's
address, so a value written by anything without the secret, or a signed value moved to another
key, must be refused, not obeyed."""

import datetime
import json

import pytest
import torch.distributed as dist

from slimserve.runtime.distributed.group import create_store
from slimserve.runtime.distributed.signed_store import ForgedMessage, SignedStore, new_secret
from slimserve.runtime.stats.rank_stats import publish_stats, read_published
from slimserve.runtime.worker.rank_process import HEADER, STEP, StoreChannel


@pytest.fixture
def store():
    return create_store(1)


def _client(store) -> dist.TCPStore:
    """Another process's view of the store: a plain client on its port (what a host on the
    network could open)."""
    return dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=datetime.timedelta(seconds=5))


def test_signed_values_round_trip_and_forgeries_are_refused(store):
    secret = new_secret()
    signed = SignedStore(store, secret)
    signed.set("msg/1/0", json.dumps(["ready", {"blocks": 4}]))
    assert json.loads(signed.get("msg/1/0")) == ["ready", {"blocks": 4}]
    _client(store).set("msg/1/1", json.dumps(["ready", {"blocks": 999}]))  # no secret
    with pytest.raises(ForgedMessage, match="msg/1/1"):
        signed.get("msg/1/1")
    store.set("msg/1/2", store.get("msg/1/0"))  # a signed value replayed under another key
    with pytest.raises(ForgedMessage):
        signed.get("msg/1/2")
    with pytest.raises(ForgedMessage):  # signed with another run's secret
        SignedStore(store, new_secret()).get("msg/1/0")


def test_a_forged_step_header_never_reaches_the_worker(store):
    """A worker's channel reads step n's header: one written without the secret raises
    ForgedMessage (the worker stops and logs it) instead of running a forged batch."""
    secret = new_secret()
    worker = StoreChannel(SignedStore(_client(store), secret), rank=1)
    driver = SignedStore(store, secret)
    good = HEADER.pack(STEP, 3, 1, 2, 1, 3, 3, 0, 0, 12)
    driver.set("step/0", good)
    assert worker.recv_bytes() == good
    _client(store).set("step/1", HEADER.pack(STEP, 10**6, 1, 2, 1, 3, 3, 0, 0, 12))
    with pytest.raises(ForgedMessage):
        worker.recv_bytes()


def test_published_stats_are_signed(store):
    signed = SignedStore(store, new_secret())
    publish_stats(signed, 1, 123, 0.5, 7)
    assert read_published(signed, 1)["memory_bytes"] == 123
    publish_stats(_client(store), 2, 10**12, 0.0, 0)  # unsigned: not believed
    assert read_published(signed, 2) == {}
