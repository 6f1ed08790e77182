"""``python -m elasticd.bench rendezvous`` measures a small job of lightweight members end to end.

Not a timed test: 20 members (10 per process) on the module's real etcd form one generation, one
leaves and the 19 others form the next; the figures are checked for being measured and consistent
with each other, not against targets, nor against one protocol's counts (it may change).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.bench.rendezvous import RendezvousSettings, render, run_rendezvous
from elasticd.bench.rendezvous_model import MODEL_N
from elasticd.config import Timeouts
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import REPO_ROOT

N = 20


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(90)
def test_a_join_round_and_a_leave_of_20_members(etcd_server: EtcdServer, tmp_path: Path) -> None:
    result = run_rendezvous(RendezvousSettings(members=N, per_process=10), tmp_path, etcd=etcd_server)
    assert result["errors"] == [], result["errors"]
    phases = result["phases"]
    assert isinstance(phases, dict)
    join, leave, idle = phases["join"], phases["leave"], phases["idle_per_s"]
    for phase in (join, leave):
        assert 0 < phase["published_s"] <= phase["all_learned_s"] < 30, phase
        assert phase["first_learned_s"] <= phase["all_learned_s"]
        assert phase["etcd_cpu_s"] > 0 and phase["member_cpu_s"] > 0
        assert phase["member_reads"] > 0 and phase["etcd_puts"] > 0
        assert phase["etcd_watch_events"] >= phase["generations"] * (N - 1)  # each member hears of it
    # (how many events and reads a round takes is the protocol's: the model's unit tests hold them)
    register = phases["register"]
    assert register["member_watches"] >= N and register["member_grant_lease"] == N and register["register_s"] > 0
    assert idle["etcd_requests"] > 0  # renewals and the periodic re-reads
    assert result["walls"]["publish_txn_ops_deleting_ready"] == 127  # type: ignore[index]
    assert result["txn_wall"] == {"128": "accepted", "129": "refused: etcdserver: too many operations in txn request"}
    assert "16384" in render(result) and "N >= 127" in render(result)
    parse = result["parse"]
    assert [row["members"] for row in parse] == list(MODEL_N), parse  # type: ignore[union-attr]
    assert all(row["whole_s"] > 0 and row["one_node_changed_s"] > 0 for row in parse), parse  # type: ignore[union-attr]
    assert "the coordinator's parse of the job" in render(result)
    assert etcd_server.running()  # a given etcd is left running


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(90)
def test_nodes_of_4_share_their_relays_which_run_apart_and_renew_one_lease_per_node(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    nodes, per_node = 4, 4
    s = RendezvousSettings(members=nodes * per_node, per_process=8, per_node=per_node)
    result = run_rendezvous(s, tmp_path, etcd=etcd_server)
    assert result["errors"] == [], result["errors"]
    phases = result["phases"]
    assert isinstance(phases, dict)
    for phase in (phases["join"], phases["leave"]):
        assert 0 < phase["published_s"] <= phase["all_learned_s"] < 30, phase
    assert phases["register"]["member_grant_lease"] == 0  # member leases are the relays' (theirs came before)
    assert sorted(p.name for p in tmp_path.glob("relays*.log")) == ["relays0.log"]  # one relay process
    idle = phases["idle_per_s"]  # etcd renewals: one per node per keepalive_s (the relays'; members ask none)
    assert 0.5 * nodes / s.keepalive_s <= idle["member_refresh_lease"] <= 1.5 * nodes / s.keepalive_s, idle
    assert idle["member_reads"] <= 2 * nodes / Timeouts().view_poll_s + 1, idle  # no reads on heartbeats


@pytest.mark.timeout(60)
def test_the_command_line_refuses_fewer_than_two_members() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elasticd.bench", "rendezvous", "--members", "1", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 1 and "--members must be >= 2" in proc.stderr
