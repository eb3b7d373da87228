"""Two training runs agree: the fused kernel path vs the torch path, parameter by parameter.

    python benchmarks/gpu_check/compare_runs.py RUN_FUSED RUN_TORCH TOLERANCE REQUIRE_FUSED

Reads each run's checkpoint.pt and summary.json; prints a JSON line with the largest relative
parameter difference (max |a - b| / max |b| per tensor), both final losses, and which path each
run logged. Exit 1 when the difference exceeds TOLERANCE, a value is not finite, or
REQUIRE_FUSED is 1 and the first run did not log the fused kernel.
"""
import json
import math
import sys
from pathlib import Path

import torch

fused_dir, torch_dir, tol, require_fused = Path(sys.argv[1]), Path(sys.argv[2]), \
    float(sys.argv[3]), sys.argv[4] == "1"
a, b = (torch.load(d / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
        for d in (fused_dir, torch_dir))
worst = max(float((a[k].double() - b[k].double()).abs().max() /
                  b[k].double().abs().max().clamp_min(1e-12)) for k in a)
losses = [json.loads((d / "summary.json").read_text()).get("final_test_loss")
          for d in (fused_dir, torch_dir)]
logs = [(d.parent / f"{d.name}.log").read_text() if (d.parent / f"{d.name}.log").is_file()
        else "" for d in (fused_dir, torch_dir)]
fused = "fused trust-ratio kernel" in logs[0]
res = {"max_rel_param_diff": worst, "tolerance": tol, "final_test_loss": losses,
       "fused_logged": fused, "torch_path_logged": "torch path" in logs[1]}
finite = all(x is not None and math.isfinite(x) for x in losses)
ok = math.isfinite(worst) and worst <= tol and finite and (fused or not require_fused)
print(json.dumps({**res, "ok": ok}))
sys.exit(0 if ok else 1)
