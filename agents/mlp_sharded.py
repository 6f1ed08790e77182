"""The default workload sharded: the MLP of agents/mlp.py, each layer sharded with FSDP2 over its
replica, trained with AdamW and a step learning-rate schedule.

Run by agents started with ``--replica-size K`` (``nproc_per_node`` a multiple of K): each K
workers of a node form one replica that holds one copy of the model, sharded among them; the job
is data parallel across replicas. With ``replica_size`` 1 the same model trains data parallel,
unsharded. ``--reference`` trains the same model on the same global batches in this one process,
without elasticd or any process group: what a fault-free job must end with. ``--plain K`` is the
same training as plain HSDP without elasticd, under torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``): FSDP2 over a (replicate, shard) mesh of shard size K, each rank
its share of every global batch; it writes its step end times to ``--out`` (the benchmark's
baseline). Exit codes: 0 done, 2 a fatal elasticd error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the agents dir: make_dataset/make_model

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mlp import make_dataset, make_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300, help="train until this many steps are committed")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-every", type=int, default=100, help="the schedule halves the learning rate this often")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--audit", default=None, help="append one JSON line per committed step here")
    p.add_argument(
        "--save-final",
        default=None,
        help="write the final full parameters here (torch.save); a sharded worker writes <this>.<node>.<local rank>",
    )
    p.add_argument("--reference", action="store_true", help="train in this process alone, without elasticd")
    p.add_argument("--plain", type=int, default=0, metavar="K", help="plain HSDP without elasticd, shards of K ranks")
    p.add_argument("--out", default=None, help="--plain: write the step end times here (JSON)")
    return p.parse_args(argv)


def make(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = make_model(args.features, args.hidden, args.classes, args.seed)
    mesh = None
    if args.plain:
        from torch.distributed.device_mesh import init_device_mesh

        world = int(os.environ["WORLD_SIZE"])
        mesh = init_device_mesh("cpu", (world // args.plain, args.plain), mesh_dim_names=("replicate", "shard"))
    elif not args.reference:
        import elasticd

        if elasticd.worker_env_from_environ().replica_size > 1:
            mesh = elasticd.replica_mesh()  # joins this worker's replica
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_every, gamma=0.5)
    return model, optimizer, scheduler


def reference(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, skip: int = 0) -> dict[str, torch.Tensor]:
    """The same steps in one process: each step's whole global batch, in the elastic sampler's order;
    the final parameters. ``skip``: leave that step's batch out (what a lost step would do)."""
    from elasticd.worker.data.sampler import ElasticSampler

    model, optimizer, scheduler = make(args)
    sampler = ElasticSampler(args.samples, args.global_batch, args.seed)
    epoch, position = 0, 0
    for step in range(1, args.steps + 1):
        batch = sampler.batch(step, epoch, position, 0, 1)
        if step != skip:
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch.indices]), y[batch.indices]).backward()
            optimizer.step()
            scheduler.step()  # type: ignore[attr-defined]
        epoch, position = sampler.normalize(*sampler.after(batch), 1)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.save_final:
        torch.save(final, args.save_final)
    return final


def plain(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> None:
    """Plain HSDP, torch alone: each rank trains on its share of every global batch."""
    import json

    import torch.distributed as dist

    from elasticd.worker.data.sampler import ElasticSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = make(args)
    sampler = ElasticSampler(args.samples, args.global_batch, args.seed)
    epoch, position, ends = 0, 0, []
    for step in range(1, args.steps + 1):
        batch = sampler.batch(step, epoch, position, rank, world)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        optimizer.zero_grad()
        F.cross_entropy(model(x[batch.indices]), y[batch.indices]).backward()
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]
        epoch, position = sampler.normalize(*sampler.after(batch), world)
        ends.append(time.time())
    if args.out:
        Path(args.out).write_text(json.dumps({"t": ends}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    x, y = make_dataset(args.samples, args.features, args.classes, args.seed)
    if args.reference:
        reference(args, x, y)
        return 0
    if args.plain:
        plain(args, x, y)
        return 0
    import elasticd
    from elasticd.log import configure_logging

    configure_logging()
    try:
        model, optimizer, scheduler = make(args)
        trainer = elasticd.ElasticTrainer(
            model,
            optimizer,
            dataset_size=args.samples,
            global_batch_size=args.global_batch,
            seed=args.seed,
            audit_path=args.audit,
            state={"scheduler": scheduler},
        )
        with trainer:
            for batch in trainer.batches(max_steps=args.steps):
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if trainer.step(F.cross_entropy(model(x[batch.indices]), y[batch.indices])):
                    scheduler.step()  # type: ignore[attr-defined]
            if trainer.step_count >= args.steps:
                # a sharded model's full tensors: the replica's ranks gather them together
                full = {k: getattr(v, "full_tensor", v.detach)() for k, v in model.state_dict().items()}
                if args.save_final:
                    env = trainer.env
                    torch.save(full, f"{args.save_final}.{env.node_id}.{env.local_rank}")
    except elasticd.ElasticdError as exc:
        print(f"elasticd: fatal: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
