"""One generation's process group: its build and abort (gloo, NCCL), its sealed store, and the
bounded collectives on it."""
