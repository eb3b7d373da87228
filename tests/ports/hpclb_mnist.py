"""horovod_mnist.py written on hpclb's own API (hpclb.init, hpclb.broadcast_parameters,
hpclb.DistributedOptimizer, hpclb.allreduce): the same training, to compare results with.
Prints the same JSON line on rank 0."""
import argparse
import hashlib
import json

import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from mnist_data import Net, mnist

import hpclb

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--data-dir", default="./data/mnist")
parser.add_argument("--samples", type=int, default=None)


def evaluate(model, loader, n: int):
    model.eval()
    loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.max(1, keepdim=True)[1].eq(target.view(-1, 1)).float().sum().item()
    return (hpclb.allreduce(torch.tensor(loss / n)).item(),
            hpclb.allreduce(torch.tensor(correct / n)).item())


def main(args):
    comm = hpclb.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = mnist(args.data_dir, args.samples)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=comm.world_size, rank=comm.rank)
    loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                         sampler=sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=comm.world_size, rank=comm.rank)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)
    model = Net()
    opt = optim.SGD(model.parameters(), lr=args.lr * comm.world_size, momentum=args.momentum)
    hpclb.broadcast_parameters(model)
    hpclb.broadcast_optimizer_state(opt)
    opt = hpclb.DistributedOptimizer(opt, model)
    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        for data, target in loader:
            opt.zero_grad()
            F.nll_loss(model(data), target).backward()
            opt.step()
        loss, accuracy = evaluate(model, test_loader, len(test_sampler))
    if comm.rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        print(json.dumps({"test_loss": loss, "test_accuracy": accuracy, "size": comm.world_size,
                          "weights": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}))


if __name__ == "__main__":
    main(parser.parse_args())
