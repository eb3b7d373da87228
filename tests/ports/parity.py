"""1 process vs N ranks on hpclb's library API, step by step (tests/test_parity_fp32.py).

A port of PyTorch's MNIST example (``examples/mnist/main.py``: its Net without the two dropout
layers, whose per-rank streams would make 1 process and N ranks differ by design; Adadelta at
lr 1.0; batch 64; 3000 training images: 47 steps, the last one 56 images), or an LSTM over the
28 rows of an image, trained on the same global batches at any world size
(``hpclb.shard_loader``; each rank's mean loss weighted by ``hpclb.share_weight``, so uneven
shares give the global mean too) in float32 and/or float64. For every dtype rank 0 prints one
JSON line: the world size, the global mean loss of every step (``hpclb.mean_over_ranks`` over
the ranks' shares) and the final parameters' SHA-256; ``--params-out DIR`` also saves them to
``DIR/params-<dtype>.pt`` (rank 0). Deterministic with one torch thread (the script sets it).

    python tests/ports/parity.py --dtype float32,float64 --params-out /tmp/one
    mpirun -n 2 --bind-to none python tests/ports/parity.py --dtype float32,float64 \\
        --params-out /tmp/two

The options select the library paths a port may take (accumulation in hpclb's or Horovod's
loop, clipping inside ``step()`` or ``clip_grad_norm_`` after ``backward()``, ``zero_grad`` of
the optimizer or of the model, an hpclb optimizer, the LEGW schedule). It reads the IDX files
itself and calls only what hpclb's library API has offered since its first commit (2026-11-30),
so that the same script runs on older commits (``PYTHONPATH=<worktree>``, a bisect); Horovod's
loop with a short last window alone calls ``sync.skip_micro_batch()`` (since 2026-12-03): its
losses weighted ``k / given`` give, bit for bit, the update that ``step()`` made of a short
window before it was ``hpclb.horovod``'s alone (the mean over the micro-batches given)."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hpclb

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=("cnn", "lstm"), default="cnn")
parser.add_argument("--smooth", action="store_true",
                    help="the CNN with ELU and average pooling (no kinks: see Net)")
parser.add_argument("--dtype", default="float32", help="float32, float64 or both, comma-separated")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--samples", type=int, default=3000)
parser.add_argument("--optimizer", choices=("adadelta", "sgd", "adam", "lars", "lamb"),
                    default="adadelta")
parser.add_argument("--lr", type=float, default=None, help="default: the optimizer's below")
parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per update")
parser.add_argument("--loop", choices=("hpclb", "horovod"), default="hpclb",
                    help="step() after every backward (hpclb's loop) or once after the "
                         "window's backward passes (Horovod's; the epoch's last window short, "
                         "its missing micro-batches counted with skip_micro_batch())")
parser.add_argument("--clip", type=float, default=None, help="DistributedOptimizer(grad_clip_norm)")
parser.add_argument("--clip-after-backward", type=float, default=None,
                    help="torch.nn.utils.clip_grad_norm_ after backward() (DDP's idiom)")
parser.add_argument("--zero-grad", choices=("optimizer", "model"), default="optimizer",
                    help="model: model.zero_grad() (set_to_none, as word_language_model does)")
parser.add_argument("--legw", type=int, default=None, metavar="B0",
                    help="hpclb.legw from B0 to the global batch (warmup 0.1 epochs at B0)")
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--data-dir", default="data/mnist")
parser.add_argument("--params-out", default=None, metavar="DIR")

DEFAULT_LR = {"adadelta": 1.0, "sgd": 0.05, "adam": 1e-3, "lars": 1.0, "lamb": 1e-2}


class Net(nn.Module):
    """PyTorch's examples/mnist Net, without its two dropout layers; ``smooth``: ELU and average
    pooling in place of ReLU and max pooling. A kink (a ReLU at 0, a max-pool's near-tie) turns
    a rounding-sized difference into a discrete one when it flips: the fp32 gap of the ReLU Net
    between 1 process and N ranks then jumps 100-10,000 fold at a step that depends on the
    trajectory (measured: none in 47 steps on 3000 images, at step 19 of 24 on 1500 at 2 ranks,
    at step 11 at 3 ranks), while fp64 stays at 1e-16 and the smooth Net at the fp32 floor."""

    def __init__(self, smooth: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)
        self.act = F.elu if smooth else F.relu
        self.pool = F.avg_pool2d if smooth else F.max_pool2d

    def forward(self, x):
        x = self.act(self.conv1(x))
        x = self.act(self.conv2(x))
        x = torch.flatten(self.pool(x, 2), 1)
        return F.log_softmax(self.fc2(self.act(self.fc1(x))), dim=1)


class RowLSTM(nn.Module):
    """An LSTM over the image's 28 rows (hidden 64) and a linear head on the last step."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(28, 64, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.lstm(x.reshape(-1, 28, 28))
        return F.log_softmax(self.head(out[:, -1]), dim=1)


def _idx(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def mnist(data_dir: str, samples: int, dtype: torch.dtype) -> torch.utils.data.TensorDataset:
    """The first ``samples`` training images, normalised as the example does, in ``dtype``."""
    root = Path(data_dir)
    images = torch.from_numpy(_idx(root / "train-images-idx3-ubyte")[:samples].copy())
    labels = torch.from_numpy(_idx(root / "train-labels-idx1-ubyte")[:samples].copy())
    x = (images.to(dtype).unsqueeze(1) / 255 - 0.1307) / 0.3081
    return torch.utils.data.TensorDataset(x, labels.long())


def _optimizer(args, params):
    lr = args.lr or DEFAULT_LR[args.optimizer]
    if args.optimizer == "adadelta":
        return torch.optim.Adadelta(params, lr=lr)
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return (hpclb.LARS if args.optimizer == "lars" else hpclb.LAMB)(params, lr=lr)


def train(args, dtype: torch.dtype, comm) -> tuple[dict, torch.Tensor]:
    """One epoch over the samples at this world size: the JSON record and the parameters."""
    torch.manual_seed(args.seed)
    model = (Net(args.smooth) if args.model == "cnn" else RowLSTM()).to(dtype)
    hpclb.broadcast_parameters(model)
    opt = hpclb.DistributedOptimizer(_optimizer(args, model.parameters()), model,
                                     accumulation_steps=args.accumulation,
                                     grad_clip_norm=args.clip)
    k = args.accumulation
    data = mnist(args.data_dir, args.samples, dtype)
    sched = None if args.legw is None else hpclb.legw(
        opt, base_batch_size=args.legw, batch_size=args.batch_size * k, num_samples=len(data),
        epochs=1, base_warmup_epochs=0.1 * args.legw / args.batch_size)
    loader = hpclb.shard_loader(data, batch_size=args.batch_size, seed=args.seed)
    loader.batch_sampler.set_epoch(0)
    losses = []
    model.train()
    for i, (x, y) in enumerate(loader):
        n_global = min(args.batch_size, len(data) - i * args.batch_size)
        if args.loop == "hpclb" or i % k == 0:
            (model if args.zero_grad == "model" else opt).zero_grad()
        # Horovod's loop: the epoch's last window may be short (``given`` < k micro-batches);
        # its losses weighted k / given make it the mean over the micro-batches given
        given = min(k, len(loader) - i // k * k) if args.loop == "horovod" else k
        loss = F.nll_loss(model(x), y)
        (loss * (hpclb.share_weight(len(y), n_global) * (k / given))).backward()
        if args.clip_after_backward is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_after_backward)
        if args.loop == "hpclb" or i % k == k - 1 or i == len(loader) - 1:
            for _ in range(k - given):  # its missing micro-batches, counted empty
                opt.sync.skip_micro_batch()
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(hpclb.mean_over_ranks(loss.detach(), weight=len(y)))
    opt.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return ({"world_size": comm.world_size, "model": args.model, "dtype": str(dtype)[6:],
             "steps": len(losses), "losses": losses,
             "params_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}, flat)


def main(args) -> None:
    comm = hpclb.init()
    torch.set_num_threads(1)
    for name in args.dtype.split(","):
        record, flat = train(args, getattr(torch, name), comm)
        if comm.rank == 0:
            if args.params_out:
                Path(args.params_out).mkdir(parents=True, exist_ok=True)
                torch.save(flat, Path(args.params_out) / f"params-{name}.pt")
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(parser.parse_args())
