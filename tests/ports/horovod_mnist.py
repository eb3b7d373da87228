"""A Horovod PyTorch MNIST training script (the structure of Horovod's
``examples/pytorch/pytorch_mnist.py``: DistributedSampler by ``hvd.size()``/``hvd.rank()``, LR
scaled by ``hvd.size()``, ``broadcast_parameters(model.state_dict())``,
``broadcast_optimizer_state``, ``hvd.DistributedOptimizer(named_parameters=, compression=, op=,
gradient_predivide_factor=)``, metrics averaged by ``hvd.allreduce``), run on hpclb: the import
of ``horovod.torch`` is the one line changed. MNIST is read from the staged IDX files (no
torchvision). Prints one JSON line on rank 0: test loss, accuracy and a digest of the weights.
"""
import argparse
import hashlib
import json

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from mnist_data import Net, mnist

import hpclb.horovod as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--data-dir", default="./data/mnist")
parser.add_argument("--samples", type=int, default=None)


def main(args):
    def train_epoch(epoch):
        model.train()
        train_sampler.set_epoch(epoch)  # Horovod: set epoch to sampler for shuffling
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()

    def metric_average(val, name):
        return hvd.allreduce(torch.tensor(val), name=name).item()

    def test():
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        return metric_average(test_loss, "avg_loss"), metric_average(test_accuracy, "avg_accuracy")

    hvd.init()  # Horovod: initialize library
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = mnist(args.data_dir, args.samples)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)
    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        loss, accuracy = test()
    if hvd.rank() == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        print(json.dumps({"test_loss": loss, "test_accuracy": accuracy, "size": hvd.size(),
                          "weights": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}))


if __name__ == "__main__":
    main(parser.parse_args())
