"""The worker side: ``ElasticTrainer`` and what it is built from. The only package that imports torch.

``trainer`` (the public API: the loop, backward/commit, recovery), ``step`` (one member's side of a
step: micro-batches, the all_reduce with the vote, the verdict), ``rejoin`` (connect, the
rendezvous + group build + state sync of a new generation, the goodbye barrier), ``optimizers``
(stepping several optimizers, a GradScaler, linear scaling), ``data`` (the global batch and the
sampler it makes), ``loader`` (the DataLoader integration), ``checkpoints`` (a trainer's saves,
resume and ``init_from``), ``journal`` (its records: audit, progress, events), ``commit`` (the
commit rule, pure), ``collectives`` (the bucketed gradient all_reduce), ``process_group`` and
``nccl`` (groups rebuilt in-process; NCCL's build and abort sequence), ``state`` (the training
state and its arena), ``extras`` (the JSON encoding of registered objects' state dicts, pure),
``checksum`` (the state checksum), ``rng`` (the RNG states that travel with the state), ``sync``
(its transfer to newcomers), ``durable_format`` and ``durable`` (checkpoints on disk: the file
format; the writer, retention and loading), ``sampler`` (the elastic data order).
"""
