"""Compile gate of kernels/*.cu, no GPU needed.

nvcc (when on PATH): every kernel file, -cubin for sm_80, sm_90 and sm_90a with --resource-usage;
fails on an error or warning, a register spill, stack (local memory) use, or registers / static
shared memory above the limits below. NVRTC (the ``nvidia-cuda-nvrtc`` wheel of the ``test``
extra, through ctypes): the exact string hpclb/optim/fused/launcher.py hands CuPy, with the same options, for
the same architectures, with ptxas's report checked the same way; and a broken source must raise
KernelCompileError carrying the compiler's message.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hpclb.optim import fused as K

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("sm_80", "sm_90", "sm_90a")
# make test compiles for the H200's sm_90; sm_80 and sm_90a (the same source, ~4 s a compile) in
# make test-extended.
ARCH_PARAMS = [pytest.param(a, marks=[] if a == "sm_90" else [pytest.mark.extended], id=a)
               for a in ARCHS]
CU_FILES = sorted((REPO / "kernels").glob("*.cu"))

# Limits per kernel. The 1024-thread kernels must fit 64 registers (their __launch_bounds__ make
# ptxas spill rather than exceed it, so the spill check is what bites); the LAMB kernels (512
# threads: up to 128) hold the IEEE divisions of u. Static shared memory: two warp-partial arrays.
MAX_REGISTERS = {"hl_norms_pass1": 64, "hl_lars_apply": 64, "hl_lamb_pass1": 128,
                 "hl_lamb_apply": 128}
MAX_SMEM_BYTES = 1024


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per entry function: registers, smem, stack, spill_stores, spill_loads (ptxas -v text)."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            out[current] = dict(registers=0, smem=0, stack=0, spill_stores=0, spill_loads=0)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            out[current]["smem"] = int(m.group(1))
    return out


def check_resources(usage: dict[str, dict[str, int]], where: str) -> None:
    assert set(usage) == set(K.KERNELS), f"{where}: entry functions {sorted(usage)}"
    for name, u in usage.items():
        assert u["spill_stores"] == 0 and u["spill_loads"] == 0, f"{where}: {name} spills: {u}"
        assert u["stack"] == 0, f"{where}: {name} uses a stack frame: {u}"
        assert 0 < u["registers"] <= MAX_REGISTERS[name], f"{where}: {name} registers: {u}"
        assert u["smem"] <= MAX_SMEM_BYTES, f"{where}: {name} shared memory: {u}"


def test_parse_ptxas_reads_the_report():
    log = ("ptxas info    : Compiling entry function 'hl_x' for 'sm_90'\n"
           "ptxas info    : Function properties for hl_x\n"
           "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 70 registers, used 1 barriers, 784 bytes smem\n")
    assert parse_ptxas(log) == {"hl_x": dict(registers=70, smem=784, stack=8, spill_stores=4,
                                             spill_loads=4)}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ARCH_PARAMS)
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_nvcc_cubin_without_spills_within_limits(cu, arch, tmp_path):
    cmd = ["nvcc", "-cubin", f"-arch={arch}", "--resource-usage", "-Werror", "all-warnings",
           "-Xptxas", "-warn-spills,-warn-lmem-usage,-Werror", "-o", str(tmp_path / "k.cubin"),
           str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{log}"
    assert (tmp_path / "k.cubin").stat().st_size > 0
    assert "warning" not in log.lower(), log
    if cu.name == "trust_ratio.cu":
        check_resources(parse_ptxas(log), f"nvcc {arch}")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_nvcc_gate_fails_on_spills(tmp_path):
    """The same flags fail a variant whose LAMB kernels get 1024-thread launch bounds (64
    registers): the IEEE division's slow path then spills."""
    src = (REPO / "kernels" / "trust_ratio.cu").read_text()
    assert src.count("#define HL_MAX_THREADS_LAMB 512") == 1
    cu = tmp_path / "spilling.cu"
    cu.write_text(src.replace("#define HL_MAX_THREADS_LAMB 512", "#define HL_MAX_THREADS_LAMB 1024"))
    cmd = ["nvcc", "-cubin", "-arch=sm_90", "--resource-usage", "-Xptxas",
           "-warn-spills,-warn-lmem-usage,-Werror", "-o", str(tmp_path / "k.cubin"), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and re.search(r"spill|[Ll]ocal memory", log), log


needs_nvrtc = pytest.mark.skipif(K.find_nvrtc() is None,
                                 reason="libnvrtc not found (pip install -e '.[test]')")


@needs_nvrtc
def test_nvrtc_is_the_13_0_line():
    assert K.nvrtc_version() == (13, 0)


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_nvrtc_compiles_the_exact_source_cupy_gets(arch):
    source = K.kernel_source()
    assert source == (REPO / "kernels" / "trust_ratio.cu").read_text()
    cubin, log = K.nvrtc_compile(source, arch, K.NVRTC_OPTIONS + ("--ptxas-options=-v",))
    assert cubin[:4] == b"\x7fELF"
    for name in K.KERNELS:
        assert name.encode() in cubin, name
    check_resources(parse_ptxas(log), f"nvrtc {arch}")


@needs_nvrtc
def test_nvrtc_reports_a_broken_source():
    broken = K.kernel_source().replace("s_last = done == (unsigned int)(nct - 1);",
                                       "s_last = done == (unsigned int)(nct - 1)", 1)
    assert broken != K.kernel_source()
    with pytest.raises(K.KernelCompileError, match=r"NVRTC_ERROR_COMPILATION") as e:
        K.nvrtc_compile(broken, "sm_90")
    assert re.search(r"trust_ratio\.cu\(\d+\): error: expected a \";\"", e.value.log)
    with pytest.raises(K.KernelCompileError, match="INVALID_OPTION"):
        K.nvrtc_compile(K.kernel_source(), "sm_90", ("--no-such-option",))
