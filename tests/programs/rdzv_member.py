"""One lightweight rendezvous member (no torch): joins, prints each generation it joins as a JSON
line, and joins again when its generation must be abandoned or newcomers wait, as a trainer does.

Usage: rdzv_member.py ENDPOINT JOB NODE MIN_WORKERS MAX_WORKERS [COORDINATOR_GRACE_S]
With ELASTICD_RELAY_SOCKET set, its view and watches come from that node relay (``RelayedStore``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import structlog

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, WorldConfig
from elasticd.errors import ElasticdError
from elasticd.rendezvous.membership import Membership
from elasticd.relay.store import RelayedStore
from elasticd.retry import Deadline
from elasticd.store.etcd import EtcdClient
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord

POLL_S = 0.01  # as the trainer polls must_abandon() between steps


def main() -> int:
    # log lines on stderr, each in one write: the generation lines below are stdout's alone
    structlog.configure(logger_factory=structlog.WriteLoggerFactory(sys.stderr))
    endpoint, job, node, min_workers, max_workers = sys.argv[1:6]
    timeouts = Timeouts(coordinator_grace_s=float(sys.argv[6])) if len(sys.argv) > 6 else Timeouts()
    store: KeyValueStore = EtcdClient(EtcdConfig(endpoints=(endpoint,)), timeouts, RetryPolicy())
    if os.environ.get("ELASTICD_RELAY_SOCKET"):
        store = RelayedStore(
            store, Keys("/elasticd", job), os.environ["ELASTICD_RELAY_SOCKET"], timeouts, RetryPolicy()
        )
    record = MemberRecord(
        member_id=f"{node}.0.{os.getpid()}",
        node=node,
        local_rank=0,
        pid=os.getpid(),
        host="127.0.0.1",
        store_port=29500,
        signature="s" * 64,
    )
    membership = Membership(
        store,
        Keys("/elasticd", job),
        record,
        WorldConfig(job_id=job, min_workers=int(min_workers), max_workers=int(max_workers)),
        timeouts,
    )
    membership.start()
    try:
        while True:
            joined = membership.join(0, Deadline.after(timeouts.join_s))
            print(
                json.dumps(
                    {
                        "member": record.member_id,
                        "generation": joined.generation,
                        "rank": joined.rank,
                        "world": joined.world_size,
                        "t": time.time(),
                    }
                ),
                flush=True,
            )
            while not (membership.must_abandon() or membership.join_pending()):
                time.sleep(POLL_S)
    except ElasticdError as exc:
        print(json.dumps({"member": record.member_id, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    finally:
        membership.close()


if __name__ == "__main__":
    sys.exit(main())
