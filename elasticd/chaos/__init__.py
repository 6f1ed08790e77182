"""Fault injection as a product: a real local job under random faults, judged from the outside.

Owns ``python -m elasticd.chaos``. It starts a real etcd (one server, or ``--etcd-members 3`` on
loopback) and ``--nodes`` real ``elasticd`` node agents, each running one worker of the default
workload ``agents/mlp.py``. A fault-free warm-up measures the fault-free step time at each world size
from ``--nodes`` to ``--max-nodes``: a window of ``--warmup-s`` at each, and between two windows one
more agent, started as ``node_join`` starts one. Then, at ``--max-nodes``, it injects faults at
random (seeded) for ``--minutes``, never taking the job below ``--min-nodes`` ready nodes, and
starting a replacement for every node it removes (a ``node_join`` at ``--max-nodes`` is a standby
beyond ``max_workers``). Run as root where ``ip netns`` works, every node is a host of its own: a
network namespace on a bridge of a private /24 that the run creates (and deletes, by name), so that
a host's link can be taken down (``link_down``) or flap (``link_flap``); as root where a tmpfs can
be mounted, the agents save checkpoints on a filesystem of the run's own, which
``checkpoint_readonly`` and ``checkpoint_full`` turn read-only or fill for a while; ``nan_grads``
makes one worker's gradients NaN for two steps; ``worker_hang`` hangs one worker holding the GIL. Then it lets the job finish and checks, from the
audit files, the agents' logs and ``elasticctl status`` samples only:

- every committed step 1..N was committed exactly once across all generations (a step committed in
  two generations is a repeat, a missing one is lost), and the job finished;
- the final parameters (the audit ``final`` lines) are identical on every worker that finished;
- no interval without a commit is longer than lease TTL + 2 s, except the part of it while etcd was
  down (or had no quorum) when membership had to change (a link down excuses nothing: the other
  hosts must go on without the isolated one within the bound);
- a host whose link was down was dropped (the others committed in a newer generation while it was
  cut off) and its workers rejoined after the link came back; a host whose link flapped committed
  again after;
- NaN gradients were named by the poisoned worker and skipped by every member, never applied;
- a checkpoint save failed only while the checkpoint filesystem was faulted, the earlier
  checkpoints stayed, and saves succeeded again after;
- ``elasticctl status --json`` lists exactly the live workers, give or take lease TTL + 1 s;
- no Python traceback appears in any agent's or worker's log;
- ``elasticd.audit.check`` finds no violation; every agent that was not killed exits 0; an agent
  started with an existing node's id is refused (exits non-zero).

It also reports ETTR: the sum, over the steps committed in the faulted phase, of the fault-free step
time at the world size each was committed at, divided by the wall time of that phase. The baseline
is per world size because every node here shares the same few cores: a bigger world is slower per
step on this machine (on a real fleet each node brings its own hardware), and that is not time lost
to faults. A size the warm-up did not measure (below ``--nodes``, after losses) takes the nearest
measured size's time, and the report says so. The old figure, every step at the step time at
``--nodes``, is reported beside it (``ettr_single_baseline``).

The decisions are pure functions: ``schedule`` (the fault kinds; ``choose_fault`` picks the next
fault from a ``ClusterView`` and a ``random.Random``; the settings and their flags), ``evidence``
(the records, parsed from the audit files and the logs), ``judge`` (``find_stalls``,
``step_findings``, ``final_findings``, ``status_findings`` and ``judge`` check the invariants over
them), ``ettr`` (``fault_free_step_by_world`` and ``ettr_by_world`` make the ETTR figure) and
``report`` (the table and the JSON object). ``netns`` plans and makes the network-namespace hosts;
``__main__``'s ``ChaosRun`` does the I/O. It holds no training, rendezvous or supervision logic, and
it ends every process it started, by PID or by the process group it created, on every way out.
Nothing in the library imports it.

``--scenario bug`` injects no fault: every rank raises the same exception at ``--raise-at-step``,
and it checks that every agent exits 3 within 2 x lease TTL + one restart of the first failure
record and that ``elasticctl status`` reports the job failed at that step, naming the exception
(``bug``).

Usage::

    python -m elasticd.chaos [--minutes 5] [--mean-interval-s 10] [--seed S] [--faults a,b,...]
                             [--nodes 3] [--min-nodes 2] [--max-nodes N] [--etcd-members 1|3]
                             [--netns|--no-netns] [--link-down-s S] [--warmup-s 10] [--json]
                             [--workdir DIR]
    python -m elasticd.chaos --scenario bug [--raise-at-step 30] [--nodes 3] [--json]

Exit codes: 0 every invariant held; 1 an invariant failed (or the run could not be completed);
2 bad arguments, no etcd binary, or ``--netns`` where netns hosts cannot be had; 130 interrupted.
"""
