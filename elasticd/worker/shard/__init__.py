"""Sharded training: a member's replica of K ranks (FSDP2 inside it), data parallel across replicas."""
