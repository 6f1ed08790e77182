"""The node relay: one agent watches the job's generation keys for its node's workers and serves them
over a Unix socket (``node``); a worker reads its view through it (``store``); ``messages`` is
their protocol. A transport between an agent and its workers, below the rendezvous."""
