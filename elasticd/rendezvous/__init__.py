"""Membership and generations: the pure decision (``decide``) and its executor (``membership``)."""
