"""Load a sharded elasticd checkpoint with torch.distributed.checkpoint alone, as a user's plain
script would: no elasticd import, no process group, an unsharded model.

    python tests/programs/load_dcp.py CHECKPOINT_DIR OUT.pt [--features F --hidden H --classes C]

CHECKPOINT_DIR is one ``<seq>-step<step>.dcp`` directory; the model is agents/mlp.py's MLP. Writes
the model's state dict and the optimizer's (AdamW) state tensors, loaded from it, to OUT.pt
(``torch.save``: {"model": ..., "optim": ...}). Exit code 0 when loaded.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--classes", type=int, default=10)
    args = p.parse_args()
    model = torch.nn.Sequential(
        torch.nn.Linear(args.features, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.classes),
    )
    optimizer = torch.optim.AdamW(model.parameters())
    model_sd = model.state_dict()
    optim_sd = get_optimizer_state_dict(model, optimizer)  # its state tensors, keyed by parameter name
    dcp.load({"model": model_sd, "optim": {"state": optim_sd["state"]}}, checkpoint_id=args.checkpoint)
    assert not any(name.startswith("elasticd") for name in sys.modules), "this script must not import elasticd"
    torch.save({"model": model_sd, "optim": optim_sd["state"]}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
