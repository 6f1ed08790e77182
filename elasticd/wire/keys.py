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
    def finished(self) -> str:
        return f"{self.job}/finished"

    @property
    def committed(self) -> str:
        return f"{self.job}/committed"

    @property
    def checkpoint(self) -> str:
        return f"{self.job}/checkpoint"

    def member(self, member_id: str) -> str:
        return f"{self.job}/members/{member_id}"

    def ready(self, member_id: str) -> str:
        return f"{self.job}/ready/{member_id}"

    def progress(self, member_id: str) -> str:
        return f"{self.job}/progress/{member_id}"

    def event(self, name: str) -> str:
        """``events/<name>``; writers take ``name`` from ``oprecords.event_name`` (sorts by time)."""
        return f"{self.job}/events/{name}"

    @property
    def events(self) -> str:
        return f"{self.job}/events/"

    def node(self, node: str) -> str:
        """``nodes/<node>``: the node agent's record, under the agent's lease."""
        return f"{self.job}/nodes/{node}"

    def drain(self, node: str) -> str:
        """``drain/<node>``: an operator's request that this node drain (``elasticctl drain``)."""
        return f"{self.job}/drain/{node}"

    @property
    def rendezvous(self) -> tuple[str, ...]:
        """What a member reads for the rendezvous and its health checks: everything but the
        records written all the time or kept by the hundred (progress, events, nodes, drain)."""
        return (self.generation, self.abort, self.finished, self.committed, self.checkpoint,
                self.member(""), self.ready(""))

    @property
    def membership_changes(self) -> tuple[str, ...]:
        """What a member watches: the keys whose change can end a generation or start the next.
        The rest of ``rendezvous`` (committed step, checkpoint) is read by the periodic poll."""
        return (self.generation, self.abort, self.finished, self.member(""), self.ready(""))

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
