"""A worker that joins and leaves a job again and again in one process (each cycle: join, train a
few steps, leave), so that a long-lived peer goes through many generation changes."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "agents"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mlp import make_dataset, make_model  # noqa: E402

import elasticd  # noqa: E402
from elasticd.log import configure_logging  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", type=int, default=25)
    p.add_argument("--steps-per-cycle", type=int, default=2)
    p.add_argument("--audit-dir", default=None)
    args = p.parse_args()
    configure_logging()
    x, y = make_dataset(2048, 32, 10, 0)
    for cycle in range(args.cycles):
        model = make_model(32, 128, 10, 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        audit = os.path.join(args.audit_dir, f"churn{cycle}.jsonl") if args.audit_dir else None
        trainer = elasticd.ElasticTrainer(model, opt, dataset_size=2048, global_batch_size=64, audit_path=audit)
        with trainer:
            done = 0
            for batch in trainer.batches(max_steps=10**9):
                loss = F.cross_entropy(model(x[batch.indices]), y[batch.indices])
                if trainer.step(loss) is not None:
                    done += 1
                if done == args.steps_per_cycle - 1:
                    trainer.drain()  # the next committed step is this member's last
        assert trainer.drained
    return 0


if __name__ == "__main__":
    sys.exit(main())
