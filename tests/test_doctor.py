"""``hpclb doctor``: the report at one process (in process and as a subprocess for the exit
status), with faked GPUs, a changed data set, ranks that disagree, and under ``mpirun -n 2``
(the MPI-marked test runs at world size 1 in the one-process suite)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import run_bounded

from hpclb.comm.testing import ScaledComm, assert_all
from hpclb.data.manifest import write_manifest
from hpclb.errors import EXIT_FAILURE
from hpclb.tools.doctor import AGREE, ITEMS, format_report, rank_report, verdict

CPU_ONLY = not torch.cuda.is_available()


@pytest.fixture
def doctor(capsys):
    """``run(*argv) -> (rc, stdout)`` of ``hpclb doctor ARGV`` in this process (signal handlers
    put back afterwards)."""
    from hpclb import cli
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}

    def run(*argv):
        rc = cli.main(["doctor", *map(str, argv)])
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return rc, out

    yield run
    for s, h in saved.items():
        signal.signal(s, h)


def _fake_gpus(monkeypatch, n: int) -> None:
    """torch sees ``n`` GPUs (a faked driver answer); binding one is a no-op."""
    props = [SimpleNamespace(name="Fake H100", total_memory=80 * 2**30, uuid=f"aaaa-{i}",
                             multi_processor_count=132, major=9, minor=0) for i in range(n)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[int(i)])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setenv("HPCLB_CUDA_AWARE_MPI", "0")  # as the venv's Open MPI wheel


def _data_set(root, name="mnist"):
    d = root / name
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(b"0123456789")
    write_manifest(d, ["a.bin"])
    return d


def test_one_process_reports_every_item_and_is_ready_without_gpu(doctor, tmp_path):
    _data_set(tmp_path)
    rc, out = doctor("--data-dir", tmp_path)
    assert rc == 0, out
    for item in ITEMS:
        assert f"\n  {item:<9} " in out, (item, out)
    assert "mnist (verified, 1 file)" in out and "rank 0: host " in out
    assert out.rstrip().splitlines()[-1].startswith("ready: nothing blocks a job on ")
    if CPU_ONLY:
        assert "no GPU (CPU-only torch" in out or "no GPU (no GPU visible" in out


@pytest.mark.skipif(not CPU_ONLY, reason="a GPU is visible here")
def test_gpu_expected_on_a_cpu_machine_blocks_naming_the_fix(doctor):
    rc, out = doctor("--gpu", "--data-dir", "no-such-dir")
    assert rc == EXIT_FAILURE, out
    blocker = [line for line in out.splitlines() if line.startswith("blocker: device: ")]
    assert blocker and ("make install-gpu" in blocker[0] or "give the job GPUs" in blocker[0])
    assert out.rstrip().endswith("not ready: 1 blocker(s) above, each with its fix")


@pytest.mark.skipif(not CPU_ONLY, reason="a GPU is visible here")
def test_the_command_exits_0_here_and_1_with_gpu_expected(tmp_path):
    """The console script's exit status: 0 without --gpu on this CPU machine, 1 (the blocker)
    with --gpu; --json gives the same verdict."""
    hpclb = os.path.join(os.path.dirname(sys.executable), "hpclb")
    env = {**os.environ, "HPCLB_DATA": str(tmp_path), "OMP_NUM_THREADS": "1"}
    plain = run_bounded([hpclb, "doctor"], timeout=120, capture_output=True, text=True, env=env)
    assert plain.returncode == 0 and "ready: nothing blocks" in plain.stdout, plain
    gpu = run_bounded([hpclb, "doctor", "--gpu", "--json"], timeout=120, capture_output=True,
                      text=True, env=env)
    assert gpu.returncode == EXIT_FAILURE, gpu
    v = json.loads(gpu.stdout)
    assert not v["ready"] and v["blockers"][0].startswith("device: --device cuda"), v


def test_faked_gpus_one_process_takes_gpu_0_with_its_warnings(doctor, monkeypatch, tmp_path):
    _fake_gpus(monkeypatch, 2)
    rc, out = doctor("--gpu", "--data-dir", tmp_path)
    assert rc == 0, out
    assert "2 x Fake H100 (80 GiB)" in out and "device cuda:0" in out
    assert "local rank 0 -> cuda:0 (at most 2 rank(s) per node" in out
    assert "warning: MPI is not CUDA-aware: the mpi backend stages CUDA tensors" in out
    if importlib.util.find_spec("cupy") is None:
        assert "warning: CuPy not installed: LARS/LAMB's trust ratio runs on the torch path" in out
    assert "ready: nothing blocks a job on GPUs" in out


def _four_ranks_on_a_node() -> ScaledComm:
    comm = ScaledComm(4)  # 4 identical ranks, this one local rank 0 of 4
    comm.local_size = 4
    return comm


def test_more_ranks_than_gpus_blocks_unless_shared(monkeypatch, tmp_path):
    _fake_gpus(monkeypatch, 2)
    comm = _four_ranks_on_a_node()
    r = rank_report(comm, data_dir=tmp_path)
    assert r["device"] == "none" and any(
        "4 ranks on this node but 2 visible GPU(s)" in b and "--share-gpu" in b
        for b in r["blockers"]), r["blockers"]
    shared = rank_report(comm, share_gpu=True, data_dir=tmp_path)
    assert shared["device"] == "cuda:0" and not shared["blockers"], shared["blockers"]
    assert shared["items"]["gpu map"].startswith(
        "4 rank(s) on 2 visible GPU(s): local rank 0 -> cuda:0, 1 -> cuda:1, 2 -> cuda:0, "
        "3 -> cuda:1")
    v = verdict(comm.allgather_object(r))
    assert not v["ready"] and v["blockers"][0].startswith("ranks 0-3: device: 4 ranks"), v


def test_a_data_set_changed_after_fetch_blocks(tmp_path):
    d = _data_set(tmp_path)
    (d / "a.bin").write_bytes(b"9876543210")  # same size, other bytes
    r = rank_report(ScaledComm(1), data_dir=tmp_path)
    assert "mnist (CHANGED since fetched)" in r["items"]["data"]
    assert any(b.startswith(f"data: {d / 'a.bin'}: SHA-256") and "fetch it again" in b
               for b in r["blockers"]), r["blockers"]


def test_launcher_line_names_the_scheduler_and_launcher_variables(monkeypatch, tmp_path):
    from hpclb.comm.env import launcher_variables

    for var in launcher_variables():  # the suite itself may run inside a job
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("PBS_JOBID", "7.pbs")
    r = rank_report(ScaledComm(1), data_dir=tmp_path / "none")
    assert r["items"]["launcher"] == "none (one process): SLURM_JOB_ID=42 PBS_JOBID=7.pbs"
    assert r["items"]["data"].endswith("none: no such directory (hpclb data fetch NAME "
                                       "--data-dir D)")
    # a missing data directory is a warning, not silence under "ready" (fresh-user review)
    assert any(w.startswith(f"data: {tmp_path / 'none'} does not exist") for w in r["warnings"])
    assert f"warning: data: {tmp_path / 'none'} does not exist" in format_report([r], verdict([r]))


def test_ranks_that_disagree_on_versions_block_naming_each(tmp_path):
    r0 = rank_report(ScaledComm(1), data_dir=tmp_path)
    r1 = json.loads(json.dumps({**r0, "rank": 1, "versions": {**r0["versions"],
                                                              "torch": "2.0.0 (CUDA 12.1)"}}))
    v = verdict([r0, r1])
    assert not v["ready"] and len(v["disagree"]) == 1, v
    assert v["disagree"][0] == (f"torch: {r0['versions']['torch']} on rank 0 but "
                                f"2.0.0 (CUDA 12.1) on rank 1")
    text = format_report([r0, r1], v)
    assert "agree: NO (see blockers)" in text and "blocker: the ranks disagree on torch" in text


@pytest.mark.mpi
def test_every_rank_reports_and_rank_0_prints_one_line_per_rank(comm, doctor, tmp_path_factory):
    """Under mpirun -n 2 (and at world size 1): every rank returns the same status, rank 0
    alone prints, one line per rank with distinct local ranks, and the ranks agree."""
    root = tmp_path_factory.mktemp(f"doctor-{comm.rank}")
    rc, out = doctor("--json", "--data-dir", root)
    ok, why = rc == 0, f"rc {rc}"
    if comm.rank == 0:
        v = json.loads(out)
        ranks = v["ranks"]
        ok = ok and v["ready"] and not v["disagree"] and len(ranks) == comm.world_size \
            and [r["rank"] for r in ranks] == list(range(comm.world_size)) \
            and sorted(r["local_rank"] for r in ranks) == list(range(comm.world_size)) \
            and all(set(AGREE) <= set(r["versions"]) for r in ranks)
        why += f" {v['blockers']} {[(r['rank'], r['local_rank']) for r in ranks]}"
    else:
        ok, why = ok and out == "", why + f" rank {comm.rank} printed {out[:200]!r}"
    assert_all(comm, ok, why)
