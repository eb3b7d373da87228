"""ResNet-50's per-step compute time on one device: the figure the projection model assumes.

    python benchmarks/gpu_check/resnet50_step.py DEVICE BATCH IMAGE STEPS OUT_JSON

``hpclb bench model`` projects ResNet-50's scaling from an assumed compute time of one GPU's
step (``hpclb.bench.model.workloads()["resnet50"]``: forward + backward + update at 256 images
per GPU, 0.223 s, a V100 in mixed precision). This measures that time here: hpclb's ResNet-50
on random images BATCH x 3 x IMAGE x IMAGE (1000 classes), channels_last and cuDNN autotuning
on CUDA as ``hpclb train`` sets them, SGD with momentum 0.9 and weight decay 1e-4 (torch's, so
that the figure does not depend on the fused LARS kernel the other phases test), once under
bf16 autocast (the projection's mixed precision) and once in fp32 (torch's default TF32
convolutions on CUDA). For each: the median over STEPS timed steps, after 3 untimed ones, of
forward + backward (``fwd_bwd_s``) and of the whole step with the update (``step_s``), the
device synchronised before and after. Writes ``{"bf16": {...}, "fp32": {...}, "projection":
{...}}`` (``projection``: the bf16 step time beside the assumed one, with their ratio) to
OUT_JSON as soon as each precision is measured. Exit 1 when a time is not finite.
"""
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from hpclb.bench.model import workloads
from hpclb.models import build_model

UNTIMED = 3


def measure(dev, batch, image, steps, precision):
    """{fwd_bwd_s, step_s, images_per_s, ...}: median seconds of one step at ``precision``."""
    torch.manual_seed(0)
    model = build_model("resnet50", num_classes=1000).to(dev)
    x = torch.randn(batch, 3, image, image, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    fwd_bwd, whole = [], []
    for i in range(UNTIMED + steps):
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        t2 = time.perf_counter()
        if i >= UNTIMED:
            fwd_bwd.append(t1 - t0)
            whole.append(t2 - t0)
    step = statistics.median(whole)
    res = {"fwd_bwd_s": statistics.median(fwd_bwd), "step_s": step,
           "images_per_s": batch / step, "loss": float(loss.detach()), "steps_timed": steps}
    if dev.type == "cuda":
        res["max_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        torch.cuda.empty_cache()
    return res


def main() -> int:
    device, batch, image, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    w = workloads()["resnet50"]
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "batch_per_gpu": batch, "image": image, "optimizer": "SGD momentum 0.9, wd 1e-4",
           "torch": torch.__version__, "tf32_convolutions": torch.backends.cudnn.allow_tf32}
    for precision in ("bf16", "fp32"):  # bf16 first: the one the projection uses
        res[precision] = measure(dev, batch, image, steps, precision)
        bf16 = res["bf16"]["step_s"]
        res["projection"] = {
            "precision": "bf16", "batch_per_gpu": batch, "measured_step_s": bf16,
            "assumed_step_s": w.compute_s, "assumed_batch_per_gpu": w.batch_per_gpu,
            "assumed_source": w.source, "ratio_measured_over_assumed": bf16 / w.compute_s,
            "comparable": dev.type == "cuda" and batch == 256 and image == 224}
        with open(out, "w") as f:
            f.write(json.dumps(res) + "\n")
        print("RESNET50", precision, json.dumps(res[precision]), flush=True)
    ok = all(math.isfinite(res[p][k]) and res[p][k] > 0 for p in ("bf16", "fp32")
             for k in ("fwd_bwd_s", "step_s"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
