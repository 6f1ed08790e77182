"""elasticd: fault-tolerant elastic data-parallel training for PyTorch.

The worker API, two forms: the drop-in form keeps a torchrun + DDP script's loop and swaps
``DistributedDataParallel`` and ``DistributedSampler`` for elasticd's (docs/porting.md); the short
form wraps the model and optimizer in ``ElasticTrainer`` and takes batches from it (README.md).
Sharded training shards the model with FSDP2 over ``replica_mesh()`` (docs/sharded.md).
"""

from elasticd.config import CheckpointConfig, WorkerEnv
from elasticd.errors import EXIT_NO_RESTART, ElasticdError, FatalError, TransientError
from elasticd.settings import worker_env_from_environ

__all__ = [
    "Batch",
    "BatchMode",
    "CheckpointConfig",
    "DistributedDataParallel",
    "DistributedSampler",
    "EXIT_NO_RESTART",
    "ElasticTrainer",
    "ElasticdError",
    "FatalError",
    "StepResult",
    "TransientError",
    "WorkerEnv",
    "replica_mesh",
    "worker_env_from_environ",
]


def __getattr__(name: str) -> object:
    # The trainer and sampler import torch; keep `import elasticd` light for elasticctl.
    if name in ("ElasticTrainer", "StepResult"):
        from elasticd.worker import trainer

        return getattr(trainer, name)
    if name in ("DistributedDataParallel", "DistributedSampler"):
        from elasticd.worker import dropin

        return getattr(dropin, name)
    if name == "replica_mesh":
        from elasticd.worker.shard import replica

        return replica.replica_mesh
    if name in ("Batch", "BatchMode"):
        from elasticd.worker.data import sampler

        return getattr(sampler, name)
    raise AttributeError(name)
