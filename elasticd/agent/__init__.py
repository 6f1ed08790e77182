"""The node agent (``elasticd``): launches and supervises the local workers. Torch-free.

``elastic`` is the agent of elastic mode (workers use the worker API), ``restart`` the agent of
restart mode (unmodified torchrun scripts); ``supervisor`` owns the processes, ``presence`` the
node's record and id claim, ``jobview`` the reads of the job's progress (and the hang test),
``sdnotify`` systemd's notify protocol, ``metrics`` the Prometheus endpoint.
"""
