"""Probes of the training step through hpclb's own set-up (the code `hpclb train` runs).

    python benchmarks/gpu_check/probes.py bf16-dtype DEVICE RECIPE DATA OUT_JSON
    python benchmarks/gpu_check/probes.py host-reads DEVICE RECIPE DATA OUT_JSON STEPS

bf16-dtype: one MNIST-LSTM forward under the run's bf16 autocast; records the dtype of the
LSTM's output. torch's cuDNN RNN autocast wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp,
``_cudnn_rnn_cast_reflatten``) casts input, hx, cx and the flat weights to ``at::kHalf``
whatever the autocast dtype, so on CUDA the LSTM is expected to run in float16 under bf16
autocast (no loss scaler); exit 1 on CUDA when it does not (the documentation must then change).

host-reads: STEPS training steps (after one untimed) per optimizer (LARS, LAMB, Adam; fp32),
counting device-to-host reads: on CUDA the warnings of ``torch.cuda.set_sync_debug_mode("warn")``
(every synchronising call), on the CPU the calls ``item``, ``__bool__``, ``__float__``,
``__int__``, ``tolist``, ``cpu``, ``numpy`` made on tensors (a TorchFunctionMode); each read is
recorded with its site (``sites``: ``path:line function`` of the innermost caller). Target: 0
reads per step for LARS and LAMB, at most 1 for Adam; exit 1 (CUDA only) when missed.
"""
import collections
import json
import os
import sys
import tempfile
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode

from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.train.loop import train_step
from hpclb.train.setup import setup_run

READS = {"item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"}


def _site() -> str:
    """The innermost caller outside this file and ``warnings``, as ``path:line function``
    (path from its ``site-packages`` or repository root): where a read was asked for."""
    here = os.path.abspath(__file__)
    for f in reversed(traceback.extract_stack()[:-1]):
        name = os.path.abspath(f.filename)
        if name == here or name.endswith(("/warnings.py", "/torch/overrides.py")):
            continue
        short = name.split("site-packages/")[-1].split("/hpclb/", 1)
        short = "hpclb/" + short[1] if len(short) == 2 else short[0]
        return f"{short}:{f.lineno} {f.name}"
    return "?"


class CountReads(TorchFunctionMode):
    """Counts the tensor methods of READS called inside the block (CPU stand-in), by site."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _run(device, recipe, data, optimizer, precision):
    cfg = resolve(recipe, batch_size=1024, scaling="sqrt", optimizer=optimizer,
                  data_dir=data, out=tempfile.mkdtemp(prefix="gpu_check_probe_"),
                  device=device, precision=precision)
    run = setup_run(cfg, SelfCommunicator(), device=torch.device(device))
    run.task.start_epoch(0)
    return run


def _step(run, i, sums):
    """Step ``i`` counted from the run's start, wrapping into later epochs (small subsets)."""
    spe = run.schedule.steps_per_epoch
    if i and i % spe == 0:
        run.task.start_epoch(i // spe)
    return train_step(run, i % spe, sums)


def bf16_dtype(device, recipe, data):
    run = _run(device, recipe, data, None, "bf16")
    seen = []
    run.model.lstm.register_forward_hook(lambda m, i, o: seen.append(str(o[0].dtype)))
    train_step(run, 0, torch.zeros(3, dtype=torch.float64, device=run.device))
    run.close()
    cuda = run.device.type == "cuda"
    res = {"device": str(run.device), "lstm_output_dtype": seen[0] if seen else None,
           "expected_on_cuda": "torch.float16", "asserted": cuda,
           "cudnn": torch.backends.cudnn.version() if cuda else None}
    res["ok"] = bool(seen) and (not cuda or seen[0] == "torch.float16")
    return res


def host_reads(device, recipe, data, steps):
    cuda = torch.device(device).type == "cuda"
    per = {}
    for opt in ("lars", "lamb", "adam"):
        run = _run(device, recipe, data, opt, "fp32")
        sums = torch.zeros(3, dtype=torch.float64, device=run.device)
        _step(run, 0, sums)
        sites = collections.Counter()
        if cuda:
            torch.cuda.synchronize()

            def seen(message, *rest):
                if "synchroniz" in str(message):
                    sites[_site()] += 1

            # the mode is set outside the counted block: torch warns once on setting it
            # (torch/cuda/__init__.py set_sync_debug_mode), which is no read of the step's
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = seen
                try:
                    for i in range(1, steps + 1):
                        _step(run, i, sums)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        else:
            with CountReads() as c:
                for i in range(1, steps + 1):
                    _step(run, i, sums)
            sites = c.sites
        n = sum(sites.values())
        run.close()
        inner = getattr(run.optimizer, "optimizer", run.optimizer)
        per[opt] = {"reads": n, "per_step": n / steps, "path": getattr(inner, "path", None),
                    "sites": dict(sites.most_common())}
    ok = per["lars"]["reads"] == 0 and per["lamb"]["reads"] == 0 and \
        per["adam"]["per_step"] <= 1
    return {"device": device, "steps": steps, "how": "cuda sync debug mode" if cuda else
            "TorchFunctionMode counter", "optimizers": per, "asserted": cuda,
            "ok": ok or not cuda, "target_met": ok}


def main() -> int:
    what, device, recipe, data, out = sys.argv[1:6]
    if what == "bf16-dtype":
        res = bf16_dtype(device, recipe, data)
    else:
        res = host_reads(device, recipe, data, int(sys.argv[6]))
    open(out, "w").write(json.dumps(res) + "\n")
    print(what, json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
