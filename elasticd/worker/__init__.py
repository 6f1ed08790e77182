"""The worker side: ``ElasticTrainer`` and what it is built from. The only package that imports torch.

``trainer`` (the public API: the loop, backward/commit, recovery), ``rejoin`` (connect, the
rendezvous + group build + state sync of a new generation, the goodbye barrier) and
``checkpoints`` (a trainer's saves, resume and ``init_from``) orchestrate four sub-packages:
``step`` (the vote and its verdict, the per-step protocol, the optimizers' step, the records of
what was applied and confirmed), ``group`` (one generation's process group, gloo or NCCL, its
sealed store, the bounded collectives and the gradient reducer), ``state`` (the training state,
its encoding, checksum and RNG states, its transfer to newcomers, durable checkpoint files) and
``data`` (the global batch, the elastic sampler, the DataLoader integration).
"""
