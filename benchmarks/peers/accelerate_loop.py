"""The job with Hugging Face Accelerate: prepare() wraps model, optimizer and loader; the loop stays ours.

Run by run.py under torchrun (through `scaletrain launch`); Accelerate reads torchrun's environment.
"""

from __future__ import annotations

import common
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader


def main() -> None:
    args = common.parse_args()
    accelerator = Accelerator(cpu=args.device == "cpu")
    set_seed(common.SEED)
    loader = DataLoader(common.train_data(), batch_size=common.BATCH, shuffle=True, drop_last=True)
    model = common.build_model().to(accelerator.device)  # on the device before a fused AdamW sees it
    optimizer = common.build_optimizer(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss_of = common.step_loss(model)

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        return accelerator.reduce(t, reduction="sum")

    world = accelerator.num_processes
    timer = common.IntervalTimer(args.log_every, common.BATCH * world, world, accelerator.device, reduce_sum)
    model.train()
    step, epoch = 0, 0
    while step < args.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = loss_of(x, y)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), common.GRAD_CLIP)
            optimizer.step()
            step += 1
            timer.step_done(loss, args.steps)
            if step == args.steps:
                break
        epoch += 1
    common.finish("accelerate", timer, accelerator.device, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
