"""``hpclb doctor``'s checks: what one rank finds (:func:`rank_report`), what the ranks' reports
add up to (:func:`verdict`) and the text rank 0 prints (:func:`format_report`).

Every answer comes from the function the job itself would call: the device from
:func:`hpclb.comm.device.select_device` among the ranks :func:`hpclb.comm.world.gpu_peers` puts
on the same GPUs, CUDA-aware MPI from :func:`hpclb.comm.mpi.cuda_aware_mpi`, the fused kernel
compiled by :class:`hpclb.optim.fused.launcher.CupyLauncher`, the JPEG decoder from
:func:`hpclb.data.transforms.default_decoder`, the data sets checked by
:func:`hpclb.data.manifest.check_manifest`, the launcher from :mod:`hpclb.comm.env`. A
*blocker* is what would stop a job (its message names the fix); a *warning* is what makes it
slower or falls back (staging through host memory, the torch path of the trust ratio).
"""
from __future__ import annotations

import importlib.util
import platform
import socket
import sys
from collections import Counter

from hpclb import __version__
from hpclb.errors import ConfigError, DataError
from hpclb.extras import gpu_extra, installed_version

__all__ = ["AGREE", "ITEMS", "rank_report", "verdict", "format_report"]

#: the items of a report, in the order printed
ITEMS = ("python", "hpclb", "torch", "devices", "nccl", "mpi", "horovod", "cupy", "jpeg",
         "data", "launcher", "gpu map")
#: the versions every rank must share (a mix of installs is a blocker)
AGREE = ("python", "hpclb", "torch", "nccl", "mpi", "mpi4py", "horovod", "cupy")


def rank_report(comm, *, gpu: bool = False, share_gpu: bool = False, data_dir=None,
                problem: str | None = None) -> dict:
    """This rank's report: ``host``, ``rank``, ``local_rank``, ``local_size``, ``device``,
    ``items`` (:data:`ITEMS` -> one line each), ``versions`` (:data:`AGREE`), ``blockers`` and
    ``warnings`` (messages naming the fix). ``gpu``: a job on GPUs is expected (no usable GPU
    blocks); ``share_gpu`` as ``--share-gpu``; ``data_dir`` as ``--data-dir``; ``problem``: why
    the communicator could not start (a blocker). Collective: one allgather
    (:func:`~hpclb.comm.world.gpu_peers`) where the world has several ranks."""
    import torch

    r = {"host": socket.gethostname(), "rank": comm.rank, "world_size": comm.world_size,
         "local_rank": comm.local_rank, "local_size": comm.local_size, "items": {},
         "versions": {"python": platform.python_version(), "hpclb": __version__,
                      "torch": f"{torch.__version__} (CUDA {torch.version.cuda})"},
         "blockers": [f"communicator: {problem}"] if problem else [], "warnings": []}
    r["items"]["python"] = f"{platform.python_version()} ({platform.python_implementation()})"
    r["items"]["hpclb"] = __version__
    r["items"]["torch"] = (f"{torch.__version__}, CUDA {torch.version.cuda}" if torch.version.cuda
                           else f"{torch.__version__} (CPU-only build)")
    device = _placement(r, comm, gpu, share_gpu)
    _devices(r)
    for check in (_nccl, _mpi, _horovod, _cupy):
        check(r, device)
    _jpeg(r)
    if r["local_rank"] == 0:  # one rank per node reads the data
        _data(r, data_dir)
    _launcher(r)
    return r


def _placement(r: dict, comm, gpu: bool, share_gpu: bool):
    """The device this rank would take (``None`` when it cannot have one: a blocker) and the
    node's local-rank -> GPU mapping, as :func:`hpclb.comm.world.get_communicator` finds them."""
    from hpclb.comm.device import select_device, share_gpu_requested, visible_gpus
    from hpclb.comm.world import gpu_peers

    index, count = gpu_peers(comm, "auto")
    n = visible_gpus()
    try:
        device = select_device("cuda" if gpu else "auto", index, count,
                               share_gpu=share_gpu_requested(share_gpu))
    except ConfigError as e:
        r["blockers"].append(f"device: {e}")
        device = None
    r["device"] = str(device) if device is not None else "none"
    if n == 0:
        r["items"]["gpu map"] = f"local rank {index} -> cpu (no GPU visible)"
    else:
        pairs = ", ".join(f"{i} -> cuda:{i % n}" for i in range(count))
        r["items"]["gpu map"] = (f"{count} rank(s) on {n} visible GPU(s): local rank {pairs} (at "
                                 f"most {n} rank(s) per node without --share-gpu)")
    return device


def _devices(r: dict) -> None:
    import os

    import torch

    if not torch.cuda.is_available():
        why = "CPU-only torch" if not torch.version.cuda else "no GPU visible or no CUDA driver"
        r["items"]["devices"] = f"no GPU ({why}): --device auto trains on the CPU"
        return
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    kinds = Counter(f"{p.name} ({p.total_memory / 2**30:.0f} GiB)" for p in props)
    driver = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        v = driver() if driver else None
        driver = f"{v // 1000}.{v % 1000 // 10}" if v else "unknown"
    except (RuntimeError, TypeError):
        driver = "unknown"
    r["items"]["devices"] = (", ".join(f"{c} x {k}" for k, c in kinds.items())
                             + f"; driver CUDA {driver}; CUDA_VISIBLE_DEVICES "
                             + (os.environ.get("CUDA_VISIBLE_DEVICES") or "unset"))


def _nccl(r: dict, device) -> None:
    import torch

    version = None
    if torch.version.cuda:
        try:
            version = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError, TypeError):
            pass
    r["versions"]["nccl"] = version
    if version is None and getattr(device, "type", None) == "cuda":
        r["warnings"].append("this CUDA torch has no NCCL: --backend torch cannot reduce CUDA "
                             "tensors; use --backend mpi or a torch build with NCCL")
    r["items"]["nccl"] = version or ("none (CPU-only torch)" if not torch.version.cuda
                                     else "none in this torch build")


def _mpi(r: dict, device) -> None:
    from hpclb.comm.mpi import cuda_aware_mpi

    r["versions"]["mpi4py"] = installed_version("mpi4py")
    if importlib.util.find_spec("mpi4py") is None:
        r["versions"]["mpi"] = None
        r["items"]["mpi"] = "mpi4py not installed: pip install mpi4py (the mpi backend needs it)"
        return
    try:
        from mpi4py import MPI
    except ImportError as e:  # mpi4py built against an MPI library that is not found here
        r["versions"]["mpi"] = None
        r["items"]["mpi"] = f"mpi4py does not import ({e}): load the MPI it was built with"
        return
    library = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()  # C string: NUL
    r["versions"]["mpi"] = library
    try:
        aware = cuda_aware_mpi(MPI)
    except ValueError as e:  # a bad $HPCLB_CUDA_AWARE_MPI, as hpclb train would refuse it
        r["blockers"].append(f"mpi: {e}")
        aware = None
    r["items"]["mpi"] = (f"{' '.join(library.split(',')[0].split())} (mpi4py "
                         f"{r['versions']['mpi4py']}); CUDA-aware: "
                         f"{'yes' if aware else 'no' if aware is False else '?'}")
    if aware is False and getattr(device, "type", None) == "cuda":
        r["warnings"].append("MPI is not CUDA-aware: the mpi backend stages CUDA tensors through "
                             "pinned host memory (correct, slower); use --backend torch (NCCL) "
                             "or an MPI built with CUDA (docs/clusters-gpu.md)")


def _horovod(r: dict, device) -> None:
    version = r["versions"]["horovod"] = installed_version("horovod")
    if version is None:
        r["items"]["horovod"] = "not installed (only the horovod backend needs it: `make " \
                                "install-horovod` builds it)"
        return
    try:
        import horovod.torch as hvd

        built = ", ".join(f"{name} {'yes' if fn() else 'no'}" for name, fn in (
            ("MPI", hvd.mpi_built), ("Gloo", hvd.gloo_built), ("NCCL", hvd.nccl_built)))
        r["items"]["horovod"] = f"{version}, built with {built}"
    except Exception as e:  # noqa: BLE001 - a broken build: any import error
        r["items"]["horovod"] = f"{version}, does not import ({type(e).__name__}: {e})"
        r["warnings"].append(f"horovod {version} does not import: rebuild it (`make "
                             f"install-horovod`) or use --backend mpi|torch")


def _cupy(r: dict, device) -> None:
    from hpclb.optim.fused.launcher import CupyLauncher, cupy_available

    installed = importlib.util.find_spec("cupy") is not None
    imports = installed and cupy_available()  # imports CuPy as the fused kernel would
    version = r["versions"]["cupy"] = sys.modules["cupy"].__version__ if imports else None
    on_gpu = getattr(device, "type", None) == "cuda"
    fallback = "LARS/LAMB's trust ratio runs on the torch path (slower)"
    if not imports:
        why = "does not import" if installed else "not installed"
        r["items"]["cupy"] = f"{why} (pip install {gpu_extra()})"
        if on_gpu:
            r["warnings"].append(f"CuPy {why}: {fallback}; pip install {gpu_extra()}")
        return
    if not on_gpu:
        r["items"]["cupy"] = f"{version}; fused trust-ratio kernel: not checked (no GPU)"
        return
    import torch

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability(device))
    try:
        CupyLauncher(device).module()
        r["items"]["cupy"] = f"{version}; the fused trust-ratio kernel compiles for {arch}"
    except Exception as e:  # noqa: BLE001 - what fused_for refuses: compile, NVRTC, driver
        r["items"]["cupy"] = f"{version}; the fused kernel does not compile for {arch}"
        r["warnings"].append(f"the fused trust-ratio kernel does not compile on {device} "
                             f"({type(e).__name__}: {str(e)[:200]}): {fallback}; check the CUDA "
                             f"driver, CuPy and NVRTC versions (docs/clusters-gpu.md)")


def _jpeg(r: dict) -> None:
    from hpclb.data.transforms import default_decoder

    simplejpeg = installed_version("simplejpeg")
    extra = f"; simplejpeg {simplejpeg} installed" if simplejpeg else ""
    r["items"]["jpeg"] = {
        "libjpeg": f"libjpeg (hpclb's region decoder, built){extra}",
        "simplejpeg": f"simplejpeg {simplejpeg} (hpclb's region decoder not built: apt-get "
                      f"install gcc libjpeg-dev, then pip install -e .)",
        "pil": "PIL (slowest; ImageNet loads faster with pip install 'hpclb[jpeg]')",
    }[default_decoder()]


def _data(r: dict, data_dir) -> None:
    from hpclb.data.manifest import check_manifest
    from hpclb.data.paths import data_dir as resolve
    from hpclb.data.registry import DATASETS

    root = resolve(data_dir)
    if not root.is_dir():
        r["items"]["data"] = f"{root}: no such directory (hpclb data fetch NAME --data-dir D)"
        r["warnings"].append(f"data: {root} does not exist, and a recipe's built-in data set is "
                             f"read there: stage it (hpclb data fetch NAME --data-dir {root}) or "
                             f"point $HPCLB_DATA / --data-dir at the staged data")
        return
    found = []
    for name in DATASETS:
        if not (root / name).is_dir():
            continue
        try:
            n = check_manifest(root / name)
            found.append(f"{name} (verified, {n} file{'s' if n > 1 else ''})" if n else
                         f"{name} (not verified: no record of hpclb data fetch)")
        except DataError as e:
            found.append(f"{name} (CHANGED since fetched)")
            r["blockers"].append(f"data: {e}")
    r["items"]["data"] = f"{root}: {', '.join(found) or 'none of hpclb data sets'}"


def _launcher(r: dict) -> None:
    from hpclb.comm.env import launcher_kind, launcher_variables

    seen = " ".join(f"{k}={v}" for k, v in launcher_variables().items())
    r["items"]["launcher"] = f"{launcher_kind() or 'none (one process)'}" + \
        (f": {seen}" if seen else "")


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-3, 7``."""
    spans: list[list[int]] = []
    for x in sorted(ranks):
        if spans and x == spans[-1][1] + 1:
            spans[-1][1] = x
        else:
            spans.append([x, x])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _by_value(values: list) -> dict:
    """value -> the ranks that hold it, in first-seen order."""
    out: dict = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def verdict(reports: list[dict]) -> dict:
    """What the ranks' reports (rank order) add up to: ``ready`` (no blocker), ``blockers`` and
    ``warnings`` (each message once, prefixed with the ranks that raised it), ``disagree``
    (``"<item>: <value> on ranks ... but ..."`` for each :data:`AGREE` item the ranks do not
    share; a blocker) and ``hosts``."""
    out = {"hosts": len({r["host"] for r in reports})}
    for kind in ("blockers", "warnings"):
        raised = _by_value([m for r in reports for m in r[kind]])
        ranks = {m: [i for i, r in enumerate(reports) if m in r[kind]] for m in raised}
        out[kind] = [f"{_ranks(ranks[m])}: {m}" if len(reports) > 1 else m for m in raised]
    out["disagree"] = []
    for key in AGREE:
        held = _by_value([r["versions"].get(key) for r in reports])
        if len(held) > 1:
            out["disagree"].append(f"{key}: " + " but ".join(
                f"{v} on {_ranks(rs)}" for v, rs in held.items()))
    out["blockers"] += [f"the ranks disagree on {d}: install the same environment on every "
                        f"node" for d in out["disagree"]]
    out["ready"] = not out["blockers"]
    return out


def format_report(reports: list[dict], v: dict) -> str:
    """The text rank 0 prints: rank 0's items, one line per rank, the agreement, warnings,
    blockers and the verdict."""
    first = reports[0]
    lines = [f"hpclb doctor: {len(reports)} rank(s) on {v['hosts']} host(s)"]
    lines += [f"  {k:<9} {first['items'][k]}" for k in ITEMS if k in first["items"]]
    lines += [f"rank {r['rank']}: host {r['host']}, local rank {r['local_rank']} of "
              f"{r['local_size']}, device {r['device']}" for r in reports]
    if len(reports) > 1:
        lines.append("agree: " + ("every rank has the same " + ", ".join(AGREE)
                                  if not v["disagree"] else "NO (see blockers)"))
    lines += [f"warning: {w}" for w in v["warnings"]]
    lines += [f"blocker: {b}" for b in v["blockers"]]
    if not v["ready"]:
        lines.append(f"not ready: {len(v['blockers'])} blocker(s) above, each with its fix")
    else:
        on_gpu = any(r["device"].startswith("cuda") for r in reports)
        lines.append("ready: nothing blocks a job on " + ("GPUs" if on_gpu else "the CPU (no GPU; "
                     "pass --gpu to require GPUs)"))
    return "\n".join(lines)
