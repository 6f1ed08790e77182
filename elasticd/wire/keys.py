"""The etcd key layout of one job (documented in README, "etcd key layout"), both modes. Pure.

Owns every key name under ``<prefix>/<job>/``: elastic mode's rendezvous, progress, nodes, drain
and events, and restart mode's keys under ``restart/``. Never holds a record's shape (``records``,
``ops``, ``restart`` do) and never does I/O.
"""

from __future__ import annotations


class Keys:
    """The etcd key layout of one job (documented in README); ``restart_*`` are restart mode's."""

    def __init__(self, root: str, job_id: str) -> None:
        self.job = f"{root}/{job_id}"

    @property
    def prefix(self) -> str:
        return self.job + "/"

    @property
    def generation(self) -> str:
        return f"{self.job}/generation"

    @property
    def abort(self) -> str:
        return f"{self.job}/abort"

    @property
    def coordinator(self) -> str:
        """``coordinator``: who reads the members and publishes generations (leased)."""
        return f"{self.job}/coordinator"

    @property
    def verdict(self) -> str:
        """``verdict``: the coordinator's reading of the current generation."""
        return f"{self.job}/verdict"

    @property
    def finished(self) -> str:
        return f"{self.job}/finished"

    @property
    def committed(self) -> str:
        return f"{self.job}/committed"

    @property
    def checkpoint(self) -> str:
        return f"{self.job}/checkpoint"

    @property
    def roster_prefix(self) -> str:
        """``roster/``: the ranks of a large generation, by bucket of nodes (``wire.roster``)."""
        return f"{self.job}/roster/"

    def roster(self, generation: int, bucket: int) -> str:
        """``roster/<generation>/<bucket>``, zero-padded so that keys sort by generation."""
        return f"{self.roster_prefix}{generation:012d}/{bucket:03d}"

    def rosters_before(self, generation: int) -> tuple[str, str]:
        """The key range [start, end) of every roster older than ``generation``."""
        return self.roster_prefix, f"{self.roster_prefix}{generation:012d}"

    def roster_of(self, key: str) -> tuple[int, int]:
        """(generation, bucket) of a roster key.

        Raises:
            ValueError: ``key`` is not a roster key.
        """
        gen, _, bucket = key[len(self.roster_prefix) :].partition("/")
        if not key.startswith(self.roster_prefix) or not gen.isdigit() or not bucket.isdigit():
            raise ValueError(f"not a roster key: {key}")
        return int(gen), int(bucket)

    def member(self, member_id: str) -> str:
        return f"{self.job}/members/{member_id}"

    def ready(self, member_id: str) -> str:
        return f"{self.job}/ready/{member_id}"

    def progress(self, member_id: str) -> str:
        return f"{self.job}/progress/{member_id}"

    @property
    def digest(self) -> str:
        """``digest``: what the agents need of the whole job, from one read of it (``wire.digest``)."""
        return f"{self.job}/digest"

    @property
    def straggler(self) -> str:
        """``straggler``: the node being replaced as a straggler (``wire.stragglers``), leased."""
        return f"{self.job}/straggler"

    def failure(self, member_id: str) -> str:
        """``failures/<member>``: a worker's uncaught exception (``wire.failures``), not leased."""
        return f"{self.job}/failures/{member_id}"

    def event(self, name: str) -> str:
        """``events/<name>``; writers take ``name`` from ``oprecords.event_name`` (sorts by time)."""
        return f"{self.job}/events/{name}"

    @property
    def events(self) -> str:
        return f"{self.job}/events/"

    @property
    def samples(self) -> str:
        """``samples/<name>``: rank 0's ``progress`` events (``elasticctl timeline``'s step points), kept
        apart so that they never push the job's history out of ``events/``."""
        return f"{self.job}/samples/"

    def node(self, node: str) -> str:
        """``nodes/<node>``: the node agent's record, under the agent's lease."""
        return f"{self.job}/nodes/{node}"

    def cordon(self, node: str) -> str:
        """``cordon/<node>``: the node stays out of the job until uncordoned (``wire.nodefaults``)."""
        return f"{self.job}/cordon/{node}"

    def drain(self, node: str) -> str:
        """``drain/<node>``: an operator's request that this node drain (``elasticctl drain``)."""
        return f"{self.job}/drain/{node}"

    @property
    def rendezvous(self) -> tuple[str, ...]:
        """What a member reads for the rendezvous and its health checks: everything but the
        records written all the time or kept by the hundred (progress, events, nodes, drain)."""
        return (
            self.generation,
            self.abort,
            self.finished,
            self.committed,
            self.checkpoint,
            self.verdict,
            self.coordinator,
            self.roster_prefix,
            self.member(""),
            self.ready(""),
        )

    @property
    def coordinated(self) -> tuple[str, ...]:
        """What the coordinator watches: the keys whose change can end a generation or start the
        next (it reads ``rendezvous``)."""
        return (self.generation, self.abort, self.finished, self.member(""), self.ready(""))

    @property
    def member_view(self) -> tuple[str, ...]:
        """What a member reads: a few single keys, the same size at any number of members but for
        the generation record; never another member's record."""
        return (
            self.generation,
            self.abort,
            self.finished,
            self.committed,
            self.checkpoint,
            self.verdict,
            self.coordinator,
        )

    @property
    def member_watch(self) -> tuple[str, ...]:
        """What a member watches (the rest of ``member_view`` is read by the periodic poll)."""
        return (self.generation, self.abort, self.finished, self.verdict, self.coordinator)

    # Restart mode (unmodified torchrun scripts): the agents' own rendezvous, under ``restart/``.

    @property
    def restart_prefix(self) -> str:
        return f"{self.job}/restart/"

    @property
    def restart_round(self) -> str:
        return self.restart_prefix + "round"

    @property
    def restart_failed(self) -> str:
        return self.restart_prefix + "failed"

    @property
    def restart_finished(self) -> str:
        return self.restart_prefix + "finished"

    def restart_agent(self, node: str) -> str:
        """``restart/agents/<node>``: the node's agent is alive (under its lease)."""
        return self.restart_prefix + "agents/" + node

    def restart_waiting(self, node: str) -> str:
        """``restart/waiting/<node>``: the node wants into the next round (under its lease)."""
        return self.restart_prefix + "waiting/" + node

    def restart_done(self, node: str) -> str:
        return self.restart_prefix + "done/" + node
