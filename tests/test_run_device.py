"""The device a run trains on is the one its settings ask for, whoever built the communicator.

A recipe with ``device: cuda`` run through ``hpclb sweep`` (a bare SelfCommunicator) trained on
the CPU with exit 0 on a GPU machine: the first GPU sweep ran nine PTB points on the CPU
(2026-12-04). ``setup_run`` now binds ``cfg.device`` when no device was bound, and refuses a
communicator bound to another device type.
"""
from __future__ import annotations

import subprocess
import sys
from unittest import mock

import pytest
import torch
from helpers import quick_recipe

from hpclb.comm.local import SelfCommunicator
from hpclb.config import resolve
from hpclb.errors import ConfigError
from hpclb.tools import sweep
from hpclb.train.setup import run_device


def _cfg(tmp_path, device):
    return resolve(quick_recipe(tmp_path), device=device, out=str(tmp_path / "run"))


@pytest.mark.parametrize("asked", ["cpu", "auto"])
def test_a_bare_communicator_is_bound_to_the_device_asked_for(tmp_path, asked):
    comm = SelfCommunicator()
    assert run_device(_cfg(tmp_path, asked), comm) == torch.device("cpu")  # no GPU here
    assert "device" not in vars(comm)  # left unbound: a later run of auto on it picks again


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda can be bound")
def test_cuda_asked_with_no_gpu_is_refused_not_trained_on_the_cpu(tmp_path):
    with pytest.raises(ConfigError, match="--device cuda.*(no CUDA support|no GPU is visible)"):
        run_device(_cfg(tmp_path, "cuda"), SelfCommunicator())


def test_a_communicator_bound_to_another_device_type_is_refused(tmp_path):
    comm = SelfCommunicator()
    comm.device = torch.device("cpu")
    with pytest.raises(ConfigError, match="device 'cuda'.*bound to cpu"):
        run_device(_cfg(tmp_path, "cuda"), comm)
    comm.device = torch.device("meta")  # auto takes whatever was bound
    assert run_device(_cfg(tmp_path, "auto"), comm) == torch.device("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda can be bound")
def test_a_sweep_of_a_cuda_recipe_stops_on_a_machine_without_gpu(tmp_path, mnist_dir):
    recipe = quick_recipe(tmp_path, device="cuda")
    with pytest.raises(ConfigError, match=r"quick.yaml \(1 rank\(s\) per point\): the recipe's "
                                          r"device is 'cuda', but .*set the recipe's `device:` "
                                          r"to cpu or auto$"):
        sweep.run_sweep(recipe, [128], ["legw"], epochs=1, data_dir=str(mnist_dir.parent),
                        out_dir=tmp_path / "res", runs_dir=tmp_path / "runs",
                        log=lambda m: None)
    assert not (tmp_path / "res").exists() and not (tmp_path / "runs").exists()  # no point


def test_a_sweep_of_more_ranks_than_gpus_stops_before_its_first_point(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCLB_SHARE_GPU", raising=False)
    recipe = quick_recipe(tmp_path, device="cuda")
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=1), \
            mock.patch("torch.cuda.set_device"):
        with pytest.raises(ConfigError, match=r"\(2 rank\(s\) per point\): 2 ranks on this "
                                              r"node but 1 visible GPU.*HPCLB_SHARE_GPU=1"):
            sweep.run_sweep(recipe, [256], ["legw"], ranks=2, out_dir=tmp_path / "res",
                            runs_dir=tmp_path / "runs", log=lambda m: None)
        sweep._check_device(recipe, None, 1)  # one rank per point fits the one GPU
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: cuda can be bound")
def test_hpclb_train_binds_the_recipes_device_when_epochs_fixes_the_recipes_budget(tmp_path):
    """The recipe's own epochs (0.05) are shorter than its warmup; --epochs 1 makes it valid.
    The device is still read from the recipe and refused as hpclb train refuses it."""
    recipe = quick_recipe(tmp_path, device="cuda", epochs=0.05)
    r = subprocess.run([sys.executable, "-m", "hpclb", "train", recipe, "--epochs", "1",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--device cuda, but this torch" in r.stderr and "bound to" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
