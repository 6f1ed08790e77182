"""The node agent (``elasticd``): launches and supervises the local workers. Torch-free.

``elastic`` is the agent of elastic mode (workers use the worker API), ``restart`` the agent of
restart mode (unmodified torchrun scripts): two executors on one skeleton, ``daemon`` (exit codes,
signals, restart budget, stop ladder, systemd pacing), each applying a pure decision
(``elastic_decide``, ``restart_decide``); ``supervisor`` owns the processes, ``presence`` the
node's record and id claim, ``jobview`` the reads of the job's progress (its reader thread and the
hang test), ``sdnotify`` systemd's notify protocol, ``metrics`` the Prometheus endpoint.
"""
