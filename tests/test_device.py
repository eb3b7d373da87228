"""The rank -> device mapping (hpclb/comm/device.py) over the launchers' environments, with faked GPU
counts: no GPU is needed."""
from __future__ import annotations

import pytest
import torch

from hpclb.comm.device import device_info, gpus_idle_warning, select_device
from hpclb.comm.env import LOCAL_RANK_VARS, env_local_rank
from hpclb.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

RANK_VARS = {v for pair in LOCAL_RANK_VARS for v in pair}


@pytest.fixture
def env(monkeypatch):
    """A process with no launcher variables set (and all GPUs visible)."""
    for v in RANK_VARS | {"CUDA_VISIBLE_DEVICES"}:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def fake_node(local_rank, local_size, gpus, **kw):
    return select_device(kw.pop("requested", "cuda"), local_rank, local_size,
                         device_count=gpus, cuda_available=True, **kw)


@pytest.mark.parametrize("launcher", [
    {"SLURM_LOCALID": "3", "SLURM_PROCID": "7"},
    {"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_RANK": "7"},
    {"LOCAL_RANK": "3", "RANK": "7"},
    {"PMI_LOCAL_RANK": "3", "PMI_RANK": "7"},
    {"MPI_LOCALRANKID": "3", "PMI_RANK": "7"},
    {"SLURM_LOCALID": "3", "SLURM_PROCID": "7", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
     "OMPI_COMM_WORLD_RANK": "7"},  # srun direct launch of Open MPI ranks: both agree
])
def test_each_launcher_gives_the_local_rank_and_its_gpu(env, launcher):
    for k, v in launcher.items():
        env.setenv(k, v)
    assert env_local_rank() == 3
    assert fake_node(env_local_rank(), 4, 4) == torch.device("cuda", 3)


def test_no_launcher_means_no_local_rank(env):
    assert env_local_rank() is None


def test_disagreeing_launcher_variables_are_an_error_naming_them(env):
    env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    env.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match=r"OMPI_COMM_WORLD_LOCAL_RANK=1, LOCAL_RANK=2"):
        env_local_rank()


def test_slurm_localid_inherited_by_mpirun_inside_sbatch_is_ignored(env):
    # mpirun's daemon was srun task 0 of its node: every rank inherits SLURM_LOCALID=0.
    env.setenv("SLURM_LOCALID", "0")
    env.setenv("SLURM_PROCID", "1")
    env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    env.setenv("OMPI_COMM_WORLD_RANK", "6")
    assert env_local_rank() == 2
    env.setenv("OMPI_COMM_WORLD_RANK", "1")  # same global rank: the two really disagree
    with pytest.raises(ConfigError, match="SLURM_LOCALID=0"):
        env_local_rank()


def test_non_integer_launcher_variable_is_an_error(env):
    env.setenv("LOCAL_RANK", "one")
    with pytest.raises(ConfigError, match="LOCAL_RANK='one'"):
        env_local_rank()


def test_rank_mapping_wraps_over_visible_gpus_only_when_sharing():
    assert [fake_node(r, 8, 8) for r in range(8)] == [torch.device("cuda", r) for r in range(8)]
    # CUDA_VISIBLE_DEVICES=2,3 leaves torch two devices: ranks 0..3 share cuda:0/cuda:1
    assert [fake_node(r, 4, 2, share_gpu=True).index for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match="--share-gpu"):
        fake_node(3, 4, 2)
    # two ranks on one GPU (the one-GPU tests)
    assert fake_node(1, 2, 1, share_gpu=True) == torch.device("cuda", 0)


def test_cuda_visible_devices_is_what_torch_counts(env):
    env.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="no GPU is visible.*CUDA_VISIBLE_DEVICES=''"):
        fake_node(0, 1, 0)
    assert select_device("auto", 0, 1, device_count=0, cuda_available=True).type == "cpu"


def test_cuda_without_cuda_names_the_fix():
    with pytest.raises(ConfigError, match=r"make install-gpu.*--device cpu"):
        select_device("cuda", 0, 1, cuda_available=False, device_count=0)


def test_unknown_device_names_the_flag_and_choices():
    with pytest.raises(ConfigError, match=r"--device 'gpu'.*auto, cpu, cuda"):
        select_device("gpu", 0, 1)
    with pytest.raises(ConfigError, match="local_rank -1"):
        select_device("cpu", -1, 1)


def test_auto_follows_visible_gpus():
    want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert select_device("auto", 0, 1) == want
    assert select_device("auto", 1, 2, device_count=2, cuda_available=True) == torch.device(
        "cuda", 1)
    assert select_device("auto", 1, 2, device_count=4, cuda_available=False).type == "cpu"
    assert select_device("cpu", 5, 8, device_count=1, cuda_available=True).type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_auto_is_cpu_here_and_cuda_is_refused():
    assert select_device("auto", 0, 1) == torch.device("cpu")
    with pytest.raises(ConfigError, match="--device cuda"):
        select_device("cuda", 0, 1)


def test_device_info_cpu_and_idle_gpu_warning():
    info = device_info("cpu")
    assert info["device"] == "cpu" and info["name"] and info["name"] != "unknown CPU"
    assert info["memory_bytes"] > 2**28 and info["count"] == torch.cuda.device_count()
    assert device_info(torch.device("meta"))["memory_bytes"] is None
    assert gpus_idle_warning("cpu", device_count=4).startswith("warning: 4 GPU(s) visible")
    assert gpus_idle_warning("cpu", device_count=0) is None
    assert gpus_idle_warning(torch.device("cuda", 0), device_count=4) is None


class _NodeComm:
    """Facts of one rank in a pretend world; allgather_object returns ``everyone``."""

    backend = "fake"

    def __init__(self, rank, local_rank, local_size, everyone):
        self.rank, self.world_size = rank, len(everyone)
        self.local_rank, self.local_size, self._everyone = local_rank, local_size, everyone

    def allgather_object(self, obj):
        assert obj == self._everyone[self.rank]
        return self._everyone


def testgpu_peers_per_task_binding_is_not_sharing(env):
    import socket

    import hpclb.comm.world as hw
    from hpclb.comm.world import gpu_peers
    env.setattr(hw, "visible_gpu_uuids", lambda: None)  # a torch without UUIDs: the strings
    host = socket.gethostname()
    # srun --gpus-per-task=1: rank 2 of 4 on this node sees only its own GPU
    env.setenv("CUDA_VISIBLE_DEVICES", "2")
    everyone = [(host, str(i)) for i in range(4)] + [("other", "0")]
    assert gpu_peers(_NodeComm(2, 2, 4, everyone), "cuda") == (0, 1)
    # mpirun: all four see the same GPUs: the node-local rank and size
    env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    same = [(host, "0,1")] * 4
    assert gpu_peers(_NodeComm(3, 3, 4, same), "cuda") == (3, 4)
    # cpu: the same allgather (with nothing to tell), so that ranks whose device setting
    # differs (a recipe one rank cannot read) stay in step until the settings are agreed
    assert gpu_peers(_NodeComm(3, 3, 4, [None] * 4), "cpu") == (3, 4)


class _Props:
    def __init__(self, uuid):
        self.uuid = uuid


def _fake_gpus(env, uuids):
    """torch sees these GPUs (by UUID): a faked driver answer."""
    env.setattr(torch.cuda, "is_available", lambda: True)
    env.setattr(torch.cuda, "device_count", lambda: len(uuids))
    env.setattr(torch.cuda, "get_device_properties", lambda i: _Props(uuids[i]))


def test_gpu_peers_tell_gpus_apart_by_uuid_under_cgroup_binding(env):
    """A site that confines each task to its GPU by cgroup shows CUDA_VISIBLE_DEVICES=0 to
    every task: the strings agree, the GPUs differ. By UUID each rank is alone on its GPU (the
    old string comparison made it 2 ranks on 1 GPU: an error without --share-gpu)."""
    import socket

    from hpclb.comm.world import gpu_peers
    host = socket.gethostname()
    env.setenv("CUDA_VISIBLE_DEVICES", "0")
    _fake_gpus(env, ["aaaa-1"])
    everyone = [(host, ("GPU-aaaa-1",)), (host, ("GPU-bbbb-2",))]
    assert gpu_peers(_NodeComm(0, 0, 2, everyone), "cuda") == (0, 1)
    assert fake_node(*gpu_peers(_NodeComm(0, 0, 2, everyone), "cuda"), 1) == \
        torch.device("cuda", 0)
    # two ranks really on one GPU (same UUID): they are the node's 2 ranks, which need sharing
    same = [(host, ("GPU-aaaa-1",))] * 2
    assert gpu_peers(_NodeComm(1, 1, 2, same), "cuda") == (1, 2)
    with pytest.raises(ConfigError, match="2 ranks on this node but 1 visible"):
        fake_node(1, 2, 1)


def test_visible_gpu_uuids_from_the_device_properties(env):
    from hpclb.comm.device import visible_gpu_uuids
    _fake_gpus(env, ["0a1b", "2c3d"])
    assert visible_gpu_uuids() == ("GPU-0a1b", "GPU-2c3d")
    env.setattr(torch.cuda, "is_available", lambda: False)
    assert visible_gpu_uuids() == ()


@pytest.mark.parametrize("value, ok", [("1", True), ("0", False), ("", False), (None, False)])
def test_hpclb_share_gpu_lets_two_ranks_share_one_gpu(env, value, ok):
    """The two-rank scripts of the GPU check set HPCLB_SHARE_GPU=1 and call get_communicator
    without share_gpu: one visible GPU, two ranks on the node."""
    if value is not None:
        env.setenv("HPCLB_SHARE_GPU", value)
    else:
        env.delenv("HPCLB_SHARE_GPU", raising=False)
    if ok:
        assert [fake_node(r, 2, 1) for r in range(2)] == [torch.device("cuda", 0)] * 2
    else:
        with pytest.raises(ConfigError, match="HPCLB_SHARE_GPU=1"):
            fake_node(1, 2, 1)
    assert fake_node(1, 2, 1, share_gpu=True) == torch.device("cuda", 0)  # the flag still works


def test_bad_hpclb_share_gpu_names_the_variable(env):
    env.setenv("HPCLB_SHARE_GPU", "yes")
    with pytest.raises(ConfigError, match=r"HPCLB_SHARE_GPU='yes': use 1"):
        fake_node(0, 1, 1)


def test_get_communicator_honours_hpclb_share_gpu(env):
    """Through get_communicator: a backend whose node holds 2 ranks, 1 faked GPU."""
    import hpclb.comm.world as hc

    class TwoOnANode(_NodeComm):
        backend = "self"
        created_with = None

        @classmethod
        def create(cls, device, share_gpu):
            cls.created_with = share_gpu
            return cls(1, 1, 2, [None, None])

    bound = []
    _fake_gpus(env, ["aaaa"])
    env.setattr(torch.cuda, "set_device", bound.append)
    env.setattr(hc, "backend_class", lambda name: TwoOnANode)
    env.setattr(hc, "gpu_peers", lambda comm, device: (1, 2))
    env.setattr(hc, "_world", None)
    env.setenv("HPCLB_SHARE_GPU", "1")
    c = hc.get_communicator("self", device="cuda")
    assert c.device == torch.device("cuda", 0) and bound == [torch.device("cuda", 0)]
    assert TwoOnANode.created_with is True  # the backend learns it too (torch: Gloo for CUDA)
    env.setattr(hc, "_world", None)
    env.setenv("HPCLB_SHARE_GPU", "0")
    with pytest.raises(ConfigError, match="2 ranks on this node but 1 visible"):
        hc.get_communicator("self", device="cuda")
    env.setattr(hc, "_world", None)


def test_get_communicator_sets_the_device_and_checks_the_launcher(env):
    import hpclb.comm.world as hc
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS_WORLD", "SLURM_STEP_ID",
              "HOROVOD_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "MASTER_ADDR"):
        env.delenv(v, raising=False)
    env.setattr(hc, "_world", None)
    with pytest.raises(ConfigError, match="--device 'gpu'"):
        hc.get_communicator("auto", device="gpu")
    env.setenv("LOCAL_RANK", "1")  # a stale variable: one process is node-local rank 0
    with pytest.raises(ConfigError, match=r"node-local ranks are unusable on 1 rank\(s\) \(rank 0: "
                                          r"the launcher says node-local rank 1, the self "
                                          r"backend finds 0"):
        hc.get_communicator("auto")
    env.delenv("LOCAL_RANK")
    c = hc.get_communicator("auto", device="cpu")
    assert c.device == torch.device("cpu") and c.local_rank == 0 and hc._world is c
    assert hc.get_communicator("auto") is c
