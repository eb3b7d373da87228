"""A plain PyTorch training loop: the baseline `make bench-overhead` times `hpclb train` against.

The same model, data order, optimizer, LEGW schedule and per-epoch evaluation as `hpclb train`,
written by hand with torch only: the data readers and model definitions are imported (hpclb's
MNIST reader and MNIST-LSTM, or the plug-in example's MNIST digits and CNN), never hpclb's
training framework (no hpclb.train, hpclb.sync, hpclb.tasks, hpclb.schedules: checked at the
end). With --ddp it runs under torchrun (``python -m torch.distributed.run --nproc-per-node 2``)
with DistributedDataParallel over Gloo, each rank reading its share of every global batch.

Writes a JSON summary (final and per-epoch test loss and accuracy, wall time in seconds) to
--out on rank 0.

    python benchmarks/plain_loop.py --workload mnist-lstm --batch-size 1024 --epochs 2 --out s.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
EVAL_BATCH = 2000  # test samples per forward, as hpclb's evaluation
FRAMEWORK = ("hpclb.train", "hpclb.sync", "hpclb.tasks", "hpclb.schedules", "hpclb.config",
             "hpclb.comm", "hpclb.optim")


def lr_at(step: int, a) -> float:
    """LEGW (You et al., SC '19): peak LR eta0 * sqrt(k), linear warmup over W0 * k epochs from
    0, then polynomial decay (power ``a.power``) to 0 at the last step; k = B / B0."""
    n, b = a.num_samples, a.batch_size
    k = b / a.base_batch_size
    steps_per_epoch = -(-n // b)
    total = math.ceil(a.epochs * steps_per_epoch - 1e-9)
    warmup = int(math.floor(a.warmup_epochs * k * n / b + 0.5 + 1e-9))
    peak = a.base_lr * math.sqrt(k)
    ramp = min(1.0, step / warmup)  # from 0 at step 0, as the reference code
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    return ramp * peak * (1.0 - progress) ** a.power


def mnist_lstm(a):
    """MNIST (hpclb's IDX reader) and the MNIST-LSTM (1 x 128), built right after seeding."""
    from hpclb.data.mnist import load_mnist
    from hpclb.models import MnistLSTM
    train, test = load_mnist(a.data_dir)
    torch.manual_seed(a.seed)
    return MnistLSTM(hidden_size=128), train, test, lambda split, idx: split.batch(idx)


def plugin_cnn(a):
    """The plug-in example's MNIST digits and small CNN (examples/plugin, no hpclb inside)."""
    sys.path.insert(0, str(REPO / "examples" / "plugin"))
    from my_data import mnist_digits
    from my_models import small_cnn
    from torch.utils.data import default_collate
    train, test = mnist_digits(a.data_dir)
    torch.manual_seed(a.seed)

    def batch(ds, idx):
        x, y = default_collate([ds[i] for i in idx.tolist()])
        return x, torch.as_tensor(y).to(torch.int64)
    return small_cnn(channels=8), train, test, batch


def first(split, n: int):
    """The first ``n`` samples of a split (hpclb's ``data.train_samples``)."""
    if hasattr(split, "subset"):
        return split.subset(n)
    return torch.utils.data.Subset(split, range(min(n, len(split))))


def evaluate(model, test, batch, rank: int, world: int) -> tuple[float, float]:
    """Mean test loss and accuracy, each rank scoring test samples ``rank::world``."""
    model.eval()
    idx = torch.arange(rank, len(test), world)
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for s in range(0, len(idx), EVAL_BATCH):
            x, y = batch(test, idx[s:s + EVAL_BATCH])
            logits = model(x)
            sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum").double(),
                                 (logits.argmax(1) == y).sum().double(),
                                 torch.tensor(float(len(y)), dtype=torch.float64)])
    if world > 1:
        torch.distributed.all_reduce(sums)
    model.train()
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


def train(a, rank: int, world: int) -> list[dict]:
    """The loop; returns one row per epoch (train loss, test loss and accuracy, seconds)."""
    model, train_set, test, batch = (mnist_lstm if a.workload == "mnist-lstm" else plugin_cnn)(a)
    if a.train_samples:
        train_set = first(train_set, a.train_samples)
    a.num_samples = n = len(train_set)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr_at(0, a))
    b = a.batch_size
    steps_per_epoch = -(-n // b)
    total = math.ceil(a.epochs * steps_per_epoch - 1e-9)
    rows, step = [], 0
    for epoch in range(math.ceil(total / steps_per_epoch)):
        t0 = time.perf_counter()
        g = torch.Generator()
        g.manual_seed(a.seed + epoch)
        perm = torch.randperm(n, generator=g)  # one global order per epoch, cut into batches
        sums = torch.zeros(3, dtype=torch.float64)
        for i in range(min(steps_per_epoch, total - epoch * steps_per_epoch)):
            global_idx = perm[i * b:(i + 1) * b]
            x, y = batch(train_set, global_idx[rank::world])
            for group in opt.param_groups:
                group["lr"] = lr_at(step, a)
            opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            weight = world * len(y) / len(global_idx)  # the exact mean over the global batch
            (loss if weight == 1 else loss * weight).backward()
            opt.step()
            step += 1
            with torch.no_grad():
                sums += torch.stack([loss.detach().double() * len(y),
                                     (logits.argmax(1) == y).sum().double(),
                                     torch.tensor(float(len(y)), dtype=torch.float64)])
        if world > 1:
            torch.distributed.all_reduce(sums)
        test_loss, test_acc = evaluate(model, test, batch, rank, world)
        rows.append({"epoch": epoch + 1, "step": step, "train_loss": float(sums[0] / sums[2]),
                     "test_loss": test_loss, "test_accuracy": test_acc,
                     "epoch_time_s": time.perf_counter() - t0})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("mnist-lstm", "plugin-cnn"), required=True)
    p.add_argument("--batch-size", type=int, required=True, help="global batch (samples)")
    p.add_argument("--epochs", type=float, required=True)
    p.add_argument("--base-batch-size", type=int, default=128)
    p.add_argument("--base-lr", type=float, required=True, help="Adam's peak LR at B0")
    p.add_argument("--warmup-epochs", type=float, default=0.25, help="at B0 (LEGW: x k)")
    p.add_argument("--power", type=float, default=2.0, help="poly decay power")
    p.add_argument("--train-samples", type=int, default=0, help="first N (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.environ.get("HPCLB_DATA", str(REPO / "data")))
    p.add_argument("--ddp", action="store_true", help="under torchrun: DDP over Gloo")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = 0, 1
    if a.ddp:
        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = train(a, rank, world)
    framework = sorted(m for m in sys.modules if m.startswith(FRAMEWORK))
    if framework:
        raise SystemExit(f"plain_loop imported hpclb's training framework: {framework}")
    if rank == 0:
        Path(a.out).write_text(json.dumps({
            "workload": a.workload, "world_size": world, "global_batch_size": a.batch_size,
            "steps": rows[-1]["step"], "final_test_loss": rows[-1]["test_loss"],
            "final_test_accuracy": rows[-1]["test_accuracy"], "epochs": rows,
            "wall_time_s": time.perf_counter() - t0}, indent=1) + "\n")
    if a.ddp:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
