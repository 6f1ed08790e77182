"""A host gone from the network is left behind by asking, not by waiting for its lease
(``rendezvous.reach``): three workers of ``agents/mlp.py``, each on a network-namespace host of its
own (a veth pair to a bridge this test makes), with a 10 s lease; the cut host's worker is the slow one. The link of one host is taken
down (``ip link set ... down``) for at most 8 s: its lease cannot expire meanwhile (renewed at
most 1 s before the cut), so the other two can commit without it only if the reach check
noticed that its host no longer answers. Before it, they waited in the all_reduce until the link
came back (or the lease ran out). Once the link is up, the cut-off worker rejoins; the job ends
with every step committed once and identical parameters. Needs root and a working ``ip netns``."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticd.chaos.netns import NetnsHosts, ip_addresses_and_routes, netns_plan, subnets_in_use, unusable_here
from elasticd.testing.audit import check_dir
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import WorkerProcess, python_program
from tests.jobs import wait_until

pytestmark = pytest.mark.timeout(240)

STEPS = 250  # the cut and the rejoin take the first ~150 (the survivors run fast without the slow host)
CUT_SLEEP_S = 0.1  # the cut host's worker sleeps this long before each step's backward, its peers 0.02 s
CUT_MAX_S = 8.0  # the link stays down at most this long: well inside the lease (TTL 10 s)
LEASE_TTL_S = 10


@pytest.fixture
def net() -> Iterator[NetnsHosts]:
    why = unusable_here(os.getpid())
    if why:
        pytest.skip(f"needs network-namespace hosts: {why}")
    ip = shutil.which("ip")
    assert ip is not None
    hosts = NetnsHosts(netns_plan(os.getpid(), subnets_in_use(ip_addresses_and_routes(ip))), ip, lambda _: None)
    try:
        hosts.setup()
        yield hosts
    finally:
        hosts.remove()


def _commits(audit: Path) -> list[dict[str, object]]:
    if not audit.exists():
        return []
    out = []
    for line in audit.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "commit":
            out.append(rec)
    return out


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_a_host_cut_off_is_left_behind_before_its_lease_ends_and_rejoins(net: NetnsHosts, tmp_path: Path) -> None:
    bridge = net.plan.bridge_addr
    etcd = EtcdServer(extra_hosts=[bridge]).start()
    workers: list[WorkerProcess] = []
    audits = [tmp_path / f"audit{i}.jsonl" for i in range(3)]

    def tail() -> str:
        return "\n".join(
            f"--- worker {i}\n" + "\n".join(w.log_text().splitlines()[-12:]) for i, w in enumerate(workers)
        )

    try:
        for i in range(3):
            host = net.host(i)
            env = {
                "ELASTICD_ETCD_ENDPOINTS": etcd.endpoint_on(bridge),
                "ELASTICD_JOB_ID": f"reach{os.getpid()}",
                "ELASTICD_NODE_ID": f"node-{i}",
                "ELASTICD_ADVERTISE_ADDR": host.addr,
                "ELASTICD_MIN_WORKERS": "2",
                "ELASTICD_LEASE_TTL_S": str(LEASE_TTL_S),
                "ELASTICD_KEEPALIVE_S": "1",
            }
            # The cut host is the slow one: the cut lands (most likely) while it sleeps, before it sends
            # its gradients, so they go out while its link is down; its peers wait in the all_reduce,
            # leave it out (the reach check), commit the step without it; once the link is back their
            # abandoned all_reduce, still pending in gloo, completes with its gradients and sends it
            # the sum *late*. It applies that step (a branch): the survivors never confirm it, and its
            # rejoin, behind rank 0 on another lineage, discards it: never a step in two generations.
            sleep = CUT_SLEEP_S if i == 2 else 0.02
            program = net.exec_prefix(host) + python_program(
                "agents/mlp.py", "--steps", str(STEPS), "--step-sleep", str(sleep), "--audit", str(audits[i])
            )
            workers.append(WorkerProcess(program, env, tmp_path / f"worker{i}.log").start())

        def at_three() -> bool:
            return all(sum(1 for c in _commits(a) if c["world_size"] == 3) >= 30 for a in audits)

        wait_until(at_three, 90, "three workers training together", tail)
        cut = net.host(2)
        net.set_link(cut, up=False)
        cut_at = time.time()
        last_before = max(int(c["step"]) for c in _commits(audits[0]))
        try:

            def survivors_on_without_it() -> bool:  # (the job may have begun at world 2: after the cut)
                return any(c["world_size"] == 2 and float(c["t"]) > cut_at for c in _commits(audits[0])[-50:])

            wait_until(
                survivors_on_without_it,
                CUT_MAX_S,
                f"the survivors committing without the cut-off host while its lease (TTL {LEASE_TTL_S} s) still lives",
                tail,
            )
            first = next(c for c in _commits(audits[0]) if c["world_size"] == 2 and float(c["t"]) > cut_at)
            assert float(first["t"]) - cut_at < LEASE_TTL_S - 1  # its lease lived: the reach check, not its expiry
            assert int(first["step"]) <= last_before + 3
        finally:
            net.set_link(cut, up=True)
        logs = workers[0].log_text() + workers[1].log_text()
        assert "members_out_of_reach" in logs, tail()

        def rejoined() -> bool:
            mine = _commits(audits[2])
            return bool(mine) and float(mine[-1]["t"]) > cut_at and mine[-1]["world_size"] == 3

        wait_until(rejoined, 60, "the cut-off worker rejoining once its link is back", tail)
        branch = [e for e in workers[2].log_text().splitlines() if '"steps_discarded"' in e]
        print(f"the cut-off worker's steps discarded as a branch: {branch}")
        codes = [w.wait(120) for w in workers]
        assert codes == [0, 0, 0], tail()
        report = check_dir(tmp_path, 2048)
        assert report.ok, report.violations
        assert report.last_step == STEPS
        assert sorted(report.generations.values()).count(2) >= 1  # a generation without it
    finally:
        for w in workers:
            w.stop()
        etcd.stop()
