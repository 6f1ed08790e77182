"""The worker side: ``ElasticTrainer`` and what it is built from. The only package that imports torch.

``trainer`` (the step loop and recovery), ``commit`` (the commit rule, pure), ``collectives`` (the
bucketed gradient all_reduce), ``process_group`` (groups rebuilt in-process), ``checkpoint`` (the
training state and its transfer to newcomers), ``durable`` (checkpoints on disk), ``sampler``.
"""
