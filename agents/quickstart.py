"""README's worker: a model, an optimizer, an LR schedule, a DataLoader with worker processes,
clipping, made elastic. Run it with ``elasticd --nnodes 1:4 --nproc-per-node 2 ... agents/quickstart.py``."""

import torch
import torch.nn.functional as F

import elasticd


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 20)
    data = torch.utils.data.TensorDataset(x, (x[:, :5].sum(dim=1) > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
    trainer = elasticd.ElasticTrainer(model, opt, state={"scheduler": sched}, global_batch_size=64)
    for xb, yb in trainer.loader(data, max_steps=200, num_workers=2):
        if trainer.backward(F.cross_entropy(model(xb), yb)):  # averaged gradients in .grad
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if trainer.commit():  # applied by every member, or by none
                sched.step()
    print(f"rank {trainer.rank}: {trainer.step_count} steps")


if __name__ == "__main__":
    main()
