"""Membership and generations: the pure decision (``decide``) and its executor (``membership``, which
holds a ``lease``, the hot-path flags of ``watch`` and the ``publish``er of the job's records)."""
