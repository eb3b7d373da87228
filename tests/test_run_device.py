"""The device a run trains on is the one its settings ask for, whoever built the communicator.

A recipe with ``device: cuda`` run through ``hpclb sweep`` (a bare SelfCommunicator) trained on
the CPU with exit 0 on a GPU machine: the first GPU sweep ran nine PTB points on the CPU
(2026-12-04). ``setup_run`` now binds ``cfg.device`` when no device was bound, and refuses a
communicator bound to another device type.
"""
from __future__ import annotations

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
    assert comm.device == torch.device("cpu")  # kept: the step's buffers follow it


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
    with pytest.raises(ConfigError, match="quick.yaml: device 'cuda' .the recipe's device.*"
                                          "--device cuda"):
        sweep.run_sweep(recipe, [128], ["legw"], epochs=1, data_dir=str(mnist_dir.parent),
                        out_dir=tmp_path / "res", runs_dir=tmp_path / "runs",
                        log=lambda m: None)
    assert not (tmp_path / "res").exists() and not (tmp_path / "runs").exists()  # no point
