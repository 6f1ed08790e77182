"""The worker side: ``ElasticTrainer`` and what it is built from. The only package that imports torch.

``trainer`` (the step loop and recovery), ``journal`` (its records: audit, progress, events),
``commit`` (the commit rule, pure), ``collectives`` (the bucketed gradient all_reduce),
``process_group`` (groups rebuilt in-process), ``state`` (the training state and its arena),
``extras`` (the JSON encoding of registered objects' state dicts, pure), ``checksum`` (the state
checksum), ``rng`` (the RNG states that travel with the state), ``sync`` (its transfer to
newcomers), ``durable_format`` and ``durable`` (checkpoints on disk: the file format; the writer,
retention and loading), ``sampler``.
"""
