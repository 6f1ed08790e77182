"""elasticd: fault-tolerant elastic data-parallel training for PyTorch.

The worker API: build the model and optimizer as usual, wrap them in ``ElasticTrainer``, and take
batches from it. See README.md for a complete example.
"""

from elasticd.config import CheckpointConfig, WorkerEnv
from elasticd.errors import ElasticdError, FatalError, TransientError
from elasticd.settings import worker_env_from_environ

__all__ = [
    "Batch",
    "BatchMode",
    "CheckpointConfig",
    "ElasticTrainer",
    "ElasticdError",
    "FatalError",
    "StepResult",
    "TransientError",
    "WorkerEnv",
    "worker_env_from_environ",
]


def __getattr__(name: str) -> object:
    # The trainer and sampler import torch; keep `import elasticd` light for elasticctl.
    if name in ("ElasticTrainer", "StepResult"):
        from elasticd.worker import trainer

        return getattr(trainer, name)
    if name in ("Batch", "BatchMode"):
        from elasticd.worker.data import sampler

        return getattr(sampler, name)
    raise AttributeError(name)
