"""Lease renewals over one keepalive stream per endpoint (``store.keepalive``), on a real etcd:
many renewals share one stream, a lost lease answers 0, a stopped etcd fails a renewal within its
bound and the stream is replaced, and renewals go on over a new stream once etcd is back."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.store.etcd import EtcdClient
from elasticd.testing.etcd import EtcdServer


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.signal(signal.SIGCONT)
        server.stop()


def _client(server: EtcdServer, timeouts: Timeouts = Timeouts()) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=(server.endpoint,)), timeouts, RetryPolicy())


def _keepalive_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "elasticd-keepalive-stream")


def test_renewals_of_many_leases_share_one_stream_and_a_revoked_lease_answers_zero(own_etcd: EtcdServer) -> None:
    c = _client(own_etcd)
    try:
        before = _keepalive_threads()
        leases = [c.grant_lease(5) for _ in range(4)]
        ttls: list[float] = []
        lock = threading.Lock()

        def renew_all(lease: int) -> None:
            for _ in range(20):
                ttl = c.refresh_lease(lease)
                with lock:
                    ttls.append(ttl)

        threads = [threading.Thread(target=renew_all, args=(lease,)) for lease in leases]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(ttls) == 80 and all(ttl > 0 for ttl in ttls)
        assert _keepalive_threads() == before + 1  # one stream for 80 renewals of 4 leases
        c.revoke_lease(leases[0])
        assert c.refresh_lease(leases[0]) == 0.0
        assert c.refresh_lease(leases[1]) > 0
    finally:
        c.close()


def test_a_stopped_etcd_fails_a_renewal_within_its_bound_and_a_new_stream_renews_after(own_etcd: EtcdServer) -> None:
    timeouts = Timeouts()
    c = _client(own_etcd, timeouts)
    try:
        lease = c.grant_lease(30)
        assert c.refresh_lease(lease) > 0
        own_etcd.signal(signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(EtcdUnavailable):
            c.refresh_lease(lease)
        took = time.monotonic() - began
        # every attempt bounded (lease_renew_s, doubling up to etcd_request_s), plus the retries' backoff
        bound = RetryPolicy().etcd_attempts * timeouts.etcd_request_s + 2.0
        assert took < bound, (took, bound)
        own_etcd.signal(signal.SIGCONT)
        assert c.refresh_lease(lease) > 0
        own_etcd.restart()
        deadline = time.monotonic() + 20
        while True:
            try:
                assert c.refresh_lease(lease) > 0  # a lease survives a restart: etcd keeps it
                break
            except EtcdUnavailable:
                assert time.monotonic() < deadline, "no renewal within 20 s of etcd's restart"
    finally:
        c.close()
