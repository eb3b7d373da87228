"""The fused kernel against the torch path over the first STEPS training steps, beside a noise
floor: the torch path against itself, measured here in the same process.

    python benchmarks/gpu_check/fused_steps.py DEVICE RECIPE DATA OUT_JSON STEPS [--emulator LIB]

For LARS and LAMB (fp32, ``--scaling sqrt``, batch 1024; the code `hpclb train` runs): three runs
from the same seed, ``fused`` (CuPy's kernel on CUDA; on the CPU the kernel's emulator LIB of
kernels/testing, installed with ``use_fused``), ``torch`` and ``torch_again`` (both
``HPCLB_TRUST_BACKEND=torch``). After each step, per tensor, ``max |a - b| / max |b|``; the
largest over tensors is the step's difference. Chaotic growth over many steps cannot hide a
defect or fail a correct kernel in 1-3 steps.

Pass when every value is finite, the fused run took the fused path (the optimizer's ``path``),
and at every step ``fused vs torch <= max(TOL_FLOOR, 10 x noise floor)`` (the noise floor is
``torch vs torch_again`` at that step; 0 on the CPU, cuDNN's non-deterministic kernels make it
non-zero on a GPU). Writes the figures to OUT_JSON and prints them; exit 1 on a failure.
"""
import json
import math
import os
import sys
import tempfile
from contextlib import nullcontext

import torch

from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.optim import fused as K
from hpclb.train.loop import train_step
from hpclb.train.setup import setup_run

TOL_FLOOR = 1e-5   # relative to each tensor's largest entry; fp32 rounding is ~1e-7 per step


def _snapshots(device, recipe, data, optimizer, steps, backend, fused):
    os.environ["HPCLB_TRUST_BACKEND"] = "torch" if backend == "torch" else "auto"
    cfg = resolve(recipe, batch_size=1024, scaling="sqrt", optimizer=optimizer, data_dir=data,
                  out=tempfile.mkdtemp(prefix="fused_steps_"), device=device, precision="fp32")
    with K.use_fused(device, fused) if fused is not None else nullcontext():
        run = setup_run(cfg, SelfCommunicator(), device=torch.device(device))
        run.task.start_epoch(0)
        sums = torch.zeros(3, dtype=torch.float64, device=run.device)
        snaps = []
        spe = run.schedule.steps_per_epoch
        for i in range(steps):  # a small subset's epoch may be shorter than STEPS
            if i and i % spe == 0:
                run.task.start_epoch(i // spe)
            train_step(run, i % spe, sums)
            snaps.append([p.detach().double().cpu().clone() for p in run.model.parameters()])
        inner = getattr(run.optimizer, "optimizer", run.optimizer)
        path = getattr(inner, "path", None)
        run.close()
    return snaps, path


def _diff(a, b):
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in zip(a, b))


def compare(device, recipe, data, optimizer, steps, fused):
    f, f_path = _snapshots(device, recipe, data, optimizer, steps, "fused", fused)
    t, t_path = _snapshots(device, recipe, data, optimizer, steps, "torch", None)
    t2, _ = _snapshots(device, recipe, data, optimizer, steps, "torch", None)
    per = []
    for i in range(steps):
        d, floor = _diff(f[i], t[i]), _diff(t2[i], t[i])
        tol = max(TOL_FLOOR, 10 * floor)
        per.append(dict(step=i + 1, fused_vs_torch=d, noise_floor=floor, tolerance=tol,
                        ok=math.isfinite(d) and d <= tol))
    want = "cupy" if torch.device(device).type == "cuda" else "emulator"
    res = dict(optimizer=optimizer, steps=steps, fused_path=f_path, torch_path=t_path,
               expected_fused_path=want, per_step=per)
    res["ok"] = f_path == want and t_path == "torch" and all(p["ok"] for p in per)
    return res


def main(argv):
    device, recipe, data, out, steps = argv[:5]
    fused = None
    if "--emulator" in argv:  # the CPU stand-in of CuPy's kernel
        sys.path.insert(0, os.path.join(os.environ["HPCLB_KERNELS_DIR"], "testing"))
        import harness as H

        fused = K.FusedTrust(H.EmulatorLauncher(H.Emulator(argv[argv.index("--emulator") + 1])))
    res = {"device": device, "optimizers": {o: compare(device, recipe, data, o, int(steps), fused)
                                            for o in ("lars", "lamb")}}
    res["ok"] = all(r["ok"] for r in res["optimizers"].values())
    open(out, "w").write(json.dumps(res) + "\n")
    print("FUSED", json.dumps({o: [(p["fused_vs_torch"], p["noise_floor"]) for p in r["per_step"]]
                               for o, r in res["optimizers"].items()}), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
