"""A library training loop that survives preemption, as `hpclb train` does (the lines # hpclb).

SIGUSR2/SIGTERM (sent by SLURM/PBS before preempting) -> every rank agrees at the next step ->
rank 0 saves a verified checkpoint generation -> every rank exits 75 (requeue) -> the next run
with the same --out resumes: model, optimizer, LR schedule and every rank's RNG streams, so the
result is the uninterrupted run's. Also shows the collectives (hpclb.allreduce, allgather) and
hpclb.evaluate over a test set split across ranks.

Run: mpirun -n 2 python examples/preemptible.py --out run1     (again to resume)
     --signal-at N sends SIGUSR2 to the last rank after step N (to try it out).
"""
import argparse, hashlib, json, os, signal, sys
import torch
import torch.nn.functional as F
from torch import nn
import hpclb                                                                         # hpclb
from hpclb.train.rng import seed_rank                                                # hpclb

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "plugin"))
from my_data import mnist_digits  # noqa: E402 (MNIST read with numpy: `hpclb data fetch mnist`)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--signal-at", type=int, default=None)
args = parser.parse_args()
B0, B, EPOCHS, SEED = 128, 256, 2, 0
comm = hpclb.init()                                                                  # hpclb
torch.manual_seed(SEED)
train, test = mnist_digits(os.environ.get("HPCLB_DATA", "data"))
train = torch.utils.data.Subset(train, range(4096))
test = torch.utils.data.Subset(test, range(2001))  # odd on purpose: shards of 1001 and 1000
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Dropout(0.2),
                      nn.Linear(128, 10)).to(comm.device)
hpclb.broadcast_parameters(model)                                                    # hpclb
seed_rank(SEED, comm.rank)  # each rank its own dropout stream                        # hpclb
opt = hpclb.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                 model)                                              # hpclb
sched = hpclb.legw(opt, base_batch_size=B0, batch_size=B, num_samples=len(train),   # hpclb
                   epochs=EPOCHS, base_warmup_epochs=0.25)
# generator=: the loader's own seed stream, so resuming does not shift the ranks' RNG streams
loader = hpclb.shard_loader(train, batch_size=B, generator=torch.Generator())        # hpclb
ckpt = hpclb.Checkpointer(args.out, model, opt, sched, seed=SEED)                    # hpclb
start, _ = ckpt.resume()  # (0, {}) on the first run                                  # hpclb
steps_per_epoch, step = len(loader), start
for epoch in range(start // steps_per_epoch, EPOCHS):
    loader.batch_sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        if epoch * steps_per_epoch + i < step:
            continue  # done before the preemption
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(comm.device)), y.to(comm.device))
        (loss * hpclb.share_weight(len(y), B)).backward()
        opt.step()
        sched.step()
        step += 1
        if step == args.signal_at and comm.rank == comm.world_size - 1:
            os.kill(os.getpid(), signal.SIGUSR2)  # what the batch system would send
        ckpt.step_done(step)  # agreed flag; on a signal: checkpoint, exit 75         # hpclb
    last = hpclb.allreduce(loss.detach())  # the collectives: allreduce (mean), allgather, ...
    shares = hpclb.allgather(torch.tensor([len(y)]))
    if comm.rank == 0:
        print(f"epoch {epoch}: last step's loss {last.item():.4f} (shares {shares.tolist()})",
              file=sys.stderr)
ckpt.close()
metrics = hpclb.evaluate(model, test, lambda out, y: {                               # hpclb
    "accuracy": (out.argmax(1) == y).float(), "loss": F.cross_entropy(out, y, reduction="none")})
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                 for p in model.parameters())).hexdigest()[:16]
if comm.rank == 0:
    print(json.dumps({**metrics, "steps": opt.steps, "resumed_from": start,
                      "params_sha256": digest, "world_size": comm.world_size}))
