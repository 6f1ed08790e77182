"""The training recipe under elasticd (the "after" of README's porting section).

``agents/recipe_ddp.py`` with at most ten lines changed: the trainer replaces the process group,
DDP, the DistributedSampler and the checkpoint load; the DataLoader comes from the trainer;
``backward``/``commit`` replace the no_sync block and ``opt.step()``; elasticd's durable checkpoints
(``ELASTICD_CHECKPOINT_*``) replace the script's own. The scheduler and the EMA are registered, so
newcomers receive them and those checkpoints keep them. Run it with::

    elasticd --nnodes 1:4 --nproc-per-node 2 --rdzv-endpoint etcd1:2379 --rdzv-id recipe -- agents/recipe.py --steps 50
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the agents dir: recipe_parts

import torch  # noqa: E402
import elasticd  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from recipe_parts import EMA, Clusters, collate, make_model, parse_args, save_final, warmup_cosine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = warmup_cosine(opt, args.warmup, args.steps)
    ema = EMA(model, args.ema_decay)
    trainer = elasticd.ElasticTrainer(model, opt, accumulation_steps=args.accumulation, state={"scheduler": sched, "ema": ema}, init_from=args.init_from, audit_path=args.audit, seed=args.seed)
    data = Clusters(args.samples, args.features, args.classes, args.seed)
    for x, y in trainer.loader(data, max_steps=args.steps, batch_size=args.batch_size, num_workers=args.workers, collate_fn=collate):
        time.sleep(args.step_sleep)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = F.cross_entropy(model(x), y)
        if not trainer.backward(loss):
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if not trainer.commit():
            continue
        opt.zero_grad()
        sched.step()
        ema.update(model)
    if trainer.rank == 0:
        save_final(args.save_final, model, ema, sched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
