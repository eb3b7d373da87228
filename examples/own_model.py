"""Your own model and training loop, made multi-rank LEGW with hpclb (the lines marked # hpclb).
Run: python examples/own_model.py   or   mpirun -n 2 python examples/own_model.py"""
import os, sys, json
import torch
import torch.nn.functional as F
import hpclb                                                                         # hpclb

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "plugin"))
from my_data import mnist_digits  # noqa: E402 (MNIST read with numpy: `hpclb data fetch mnist`)
from my_models import MLP  # noqa: E402

B0, B, EPOCHS = 128, 512, 3
comm = hpclb.init()                                                                  # hpclb
torch.manual_seed(0)
train, test = mnist_digits(os.environ.get("HPCLB_DATA", "data"))
train = torch.utils.data.Subset(train, range(16384))
model = MLP(hidden_size=128).to(comm.device)
hpclb.broadcast_parameters(model)                                                    # hpclb
opt = hpclb.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=5e-3), model)  # hpclb
sched = hpclb.legw(opt, base_batch_size=B0, batch_size=B, num_samples=len(train),   # hpclb
                   epochs=EPOCHS, base_warmup_epochs=0.25, decay_params={"power": 2.0})
loader = hpclb.shard_loader(train, batch_size=B)                                     # hpclb
for epoch in range(EPOCHS):
    loader.batch_sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(comm.device)), y.to(comm.device))
        (loss * hpclb.share_weight(len(y), B)).backward()  # exact mean on a short last step
        opt.step()
        sched.step()
model.eval()
with torch.no_grad():
    idx = range(comm.rank, len(test), comm.world_size)
    x, y = torch.utils.data.default_collate([test[i] for i in idx])
    correct = (model(x.to(comm.device)).argmax(1).cpu() == y).float().mean()
acc = hpclb.mean_over_ranks(correct, weight=len(idx))                                # hpclb
if comm.rank == 0:
    print(json.dumps({"test_accuracy": acc, "world_size": comm.world_size, "steps": opt.steps}))
