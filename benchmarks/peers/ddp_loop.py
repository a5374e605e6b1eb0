"""The job as a hand-written DDP loop, as in the lecture: DistributedSampler + DDP + a plain loop (one process:
no DDP, as a one-GPU script).

Run by run.py under torchrun (through `scaletrain launch`): torchrun sets RANK, WORLD_SIZE, LOCAL_RANK.
"""

from __future__ import annotations

import common
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def main() -> None:
    args = common.parse_args()
    device = common.local_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    data = common.train_data()
    sampler = DistributedSampler(data, shuffle=True, seed=common.SEED, drop_last=True)
    loader = DataLoader(data, batch_size=common.BATCH, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")
    module = common.build_model().to(device)
    # One process: a one-GPU script's plain model, no DDP (nothing to average; scaletrain does not wrap either).
    model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else module
    optimizer = common.build_optimizer(module)
    loss_of = common.step_loss(model)

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    timer = common.IntervalTimer(args.log_every, common.BATCH * world, world, device, reduce_sum)
    model.train()
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_of(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), common.GRAD_CLIP)
            optimizer.step()
            step += 1
            timer.step_done(loss, args.steps)
            if step == args.steps:
                break
        epoch += 1
    common.finish("ddp", timer, device, args.out)
    del model  # DDP holds the process group: drop it before destroying the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
