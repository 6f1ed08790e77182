"""One node's relay (``relay.node.NodeRelay``) in a process of its own, as an agent runs it:
prints one JSON line when it listens, then relays until SIGTERM (or SIGKILL).

Usage: relay_node.py ENDPOINT JOB NODE SOCKET_PATH
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.relay.node import NodeRelay
from elasticd.store.etcd import EtcdClient
from elasticd.wire.keys import Keys


def main() -> int:
    endpoint, job, node, path = sys.argv[1:5]
    timeouts = Timeouts()
    store = EtcdClient(EtcdConfig(endpoints=(endpoint,)), timeouts, RetryPolicy())
    relay = NodeRelay(store, Keys("/elasticd", job), node, path, timeouts)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    relay.start()
    print(json.dumps({"relay": path}), flush=True)
    while not stop.wait(0.2):
        pass
    relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
