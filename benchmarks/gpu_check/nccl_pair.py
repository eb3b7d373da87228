"""Two processes, one allreduce through torch.distributed: NCCL on the one GPU, Gloo on the CPU.

    python benchmarks/gpu_check/nccl_pair.py DEVICE OUT_JSON SCRATCH

Starts 2 ranks of itself (a FileStore in SCRATCH, no launcher), each allreducing a tensor of
its rank + 1 on DEVICE. On the CPU (Gloo) that is a real two-rank collective: the sum must be
3. On one GPU, NCCL (2.5 and later) refuses two ranks on one device ("Duplicate GPU
detected"), which is why hpclb's ``--share-gpu`` uses Gloo for CUDA tensors: the refusal,
with that message, is the expected outcome there and is recorded as such
(``inter_rank_collective: false``); a sum of 3 (a NCCL that accepts) passes too. Anything
else (a wrong sum, another error, a hang past 45 s) fails. Writes the outcome to OUT_JSON.
"""
import json
import os
import subprocess
import sys
import time

RANK_TIMEOUT_S = 45
#: how NCCL's refusal reads (its own message, torch's wrapper, or the error class NCCL returns)
REFUSAL = ("Duplicate GPU", "Duplicated GPU", "invalid usage")


def rank_main(rank: int, device: str, store: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                                rank=rank, world_size=2)
        t = torch.full((1 << 16,), rank + 1.0, device=dev)
        dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        res = {"rank": rank, "backend": dist.get_backend(), "sum": [float(t.min()),
                                                                    float(t.max())]}
        dist.destroy_process_group()
    except Exception as e:  # NCCL's refusal arrives as a DistBackendError
        res = {"rank": rank, "error": f"{type(e).__name__}: {e}"[:600]}
    print("PAIR", json.dumps(res), flush=True)


def main(device: str, out: str, scratch: str) -> int:
    store = os.path.join(scratch, f"nccl_pair_store_{os.getpid()}")
    env = {**os.environ, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), device, store],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
             for r in range(2)]
    t0, results, logs = time.monotonic(), [], []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, RANK_TIMEOUT_S - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\nTIMED OUT"
        logs.append(text)
        results += [json.loads(x[5:]) for x in text.splitlines() if x.startswith("PAIR ")]
    print("\n".join(logs))
    sums = [r.get("sum") for r in results]
    errors = [r["error"] for r in results if "error" in r]
    if len(results) == 2 and sums == [[3.0, 3.0]] * 2:
        outcome, ok = "two-rank allreduce, sum 3 on both ranks", True
    elif device == "cuda" and len(errors) == 2 and all(
            any(m in e for m in REFUSAL) for e in errors):
        outcome, ok = "NCCL refused two ranks on one GPU (duplicate GPU), as expected", True
    else:
        outcome, ok = f"unexpected: results {results}, exit {[p.returncode for p in procs]}", False
    res = {"device": device, "world_size": 2, "outcome": outcome, "ranks": results,
           "inter_rank_collective": sums == [[3.0, 3.0]] * 2, "ok": ok}
    open(out, "w").write(json.dumps(res) + "\n")
    print("NCCL_PAIR", json.dumps(res), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        sys.exit(main(*sys.argv[1:4]))
