"""Train an MLP on scikit-learn's digits with DDP + zerofn's ZeroRedundancyOptimizer,
launched by ``torchrun``: the shape of a real training script.

Shows the drop-in in a plain ``torchrun`` job: the process group comes from
torchrun's environment (gloo on CPU, NCCL when CUDA is available), the data is
sharded with ``DistributedSampler``, and each rank keeps optimizer state only for
its share of the parameters. With ``--powersgd`` the gradients are compressed by
PowerSGD and the ZeRO step is overlapped with backward (``overlap_with_ddp=True``
and ``hook_with_zero_step``); otherwise ``zero.step()`` runs after backward.

Run::

    torchrun --nproc_per_node 2 examples/train_torchrun.py --steps 200
    torchrun --nproc_per_node 2 examples/train_torchrun.py --powersgd
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.hooks import PowerSGDState, hook_with_zero_step, powerSGD_hook


def digits(device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    """Digits (shipped with scikit-learn, no download) as train/test datasets, 80/20."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    x_np, y_np = load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32, device=device) / 16.0
    y = torch.tensor(y_np, dtype=torch.int64, device=device)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).to(device)
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DDP + zerofn ZeRO on digits, under torchrun")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--powersgd", action="store_true", help="PowerSGD + overlapped ZeRO")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets rank and world size
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    ).to(device)
    # Overlapped ZeRO gives each DDP bucket to one rank; small buckets let a
    # model this small spread over the ranks (DDP's default 25 MB is one bucket).
    bucket_cap_mb = 0.05 if args.powersgd else 25.0
    ddp = DDP(model, device_ids=[local_rank] if cuda else None, bucket_cap_mb=bucket_cap_mb)
    if args.powersgd:
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=args.lr
        )
        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, hook_with_zero_step(powerSGD_hook, ddp, zero))
    else:
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=args.lr)

    train, test = digits(device)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train, num_replicas=world_size, rank=rank, seed=0
    )
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            zero.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            if not args.powersgd:  # overlapped, the hook stepped inside backward
                zero.step()
            step += 1
            if step % 50 == 0 or step == args.steps:
                mean_loss = loss.detach()
                dist.all_reduce(mean_loss)
                if rank == 0:
                    print(f"step {step:4d}  loss {mean_loss.item() / world_size:.4f}")
            if step == args.steps:
                break
        epoch += 1

    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    owned = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
    total = sum(p.numel() for p in model.parameters())
    print(
        f"rank {rank}: test accuracy {accuracy:.2%}; optimizer state for {owned:,}/{total:,}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
