"""The job with Lightning Fabric: Fabric sets up DDP, the sampler and the device; the loop stays ours.

Run by run.py under torchrun (through `scaletrain launch`); Fabric recognises torchrun's environment.
"""

from __future__ import annotations

import os

import common
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader


def main() -> None:
    args = common.parse_args()
    fabric = Fabric(accelerator=args.device, strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                    num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
                    precision="32-true")
    fabric.launch()  # under torchrun this starts no process; it joins the group
    fabric.seed_everything(common.SEED, verbose=False)
    loader = fabric.setup_dataloaders(DataLoader(common.train_data(), batch_size=common.BATCH, shuffle=True,
                                                 drop_last=True))
    model = common.build_model().to(fabric.device)  # on the device before a fused AdamW sees it
    optimizer = common.build_optimizer(model)
    model, optimizer = fabric.setup(model, optimizer)
    loss_of = common.step_loss(model)

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        return fabric.all_reduce(t, reduce_op="sum")

    world = fabric.world_size
    timer = common.IntervalTimer(args.log_every, common.BATCH * world, world, fabric.device, reduce_sum)
    model.train()
    step, epoch = 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_of(x, y)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=common.GRAD_CLIP)
            optimizer.step()
            step += 1
            timer.step_done(loss, args.steps)
            if step == args.steps:
                break
        epoch += 1
    common.finish("fabric", timer, fabric.device, args.out)


if __name__ == "__main__":
    main()
