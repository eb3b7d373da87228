"""Fault matrix, one rank fails: it raises, it is SIGKILLed while the other waits in the step's
allreduce, or it builds a second GradientSync on the communicator. Every rank must end within the
bound, with a message naming the rank, and the last checkpoint must hold all progress made
before it (the epoch-1 checkpoint, global step 8)."""
import sys
import textwrap

import pytest
from conftest import (
    BATCH,
    MPIRUN,
    checkpoint_state,
    command,
    run,
    same_result,
    summary,
    train_args,
    write_recipe,
)

STEPS_PER_EPOCH = 1024 // BATCH
FAIL_AT = STEPS_PER_EPOCH + 3  # epoch 2, step 3: after the epoch-1 checkpoint


@pytest.mark.timeout(150)
def test_rank_raises_mid_epoch(tmp_path, record):
    """Rank 1's model raises at global step 11: exit 1 on every rank within 60 s, the message
    names rank 1 and the error; the epoch-1 checkpoint (step 8) is what --resume would use."""
    bound = 60
    cmd = command(train_args(write_recipe(tmp_path), tmp_path / "run"), ranks=2)
    rc, out, t = run(cmd, bound, env={"FAULT_MODE": "raise", "FAULT_RANK": "1",
                                      "FAULT_STEP": str(FAIL_AT)})
    assert rc != 0, out
    assert "RuntimeError on rank 1 of 2: fault_plugin: injected failure at forward 11" in out, out
    assert not (tmp_path / "run" / "summary.json").exists()
    kept = checkpoint_state(tmp_path / "run")["global_step"]
    assert kept == STEPS_PER_EPOCH, kept
    record(bound, t, rc, f"checkpoint at global step {kept} (epoch 1 end); failed at step "
                         f"{FAIL_AT}")


@pytest.mark.timeout(240)
def test_rank_sigkilled_during_allreduce(tmp_path, reference, record):
    """Rank 1 is SIGKILLed at global step 11 while rank 0 waits for it in the gradient allreduce:
    mpirun ends the job within 60 s, naming the killed rank; --resume continues from the epoch-1
    checkpoint to the uninterrupted run's result."""
    bound = 60
    recipe = write_recipe(tmp_path)
    rc, out, t = run(command(train_args(recipe, tmp_path / "run"), ranks=2), bound,
                     env={"FAULT_MODE": "kill", "FAULT_RANK": "1", "FAULT_STEP": str(FAIL_AT)})
    assert rc != 0, out
    assert "rank 1" in out and ("signal 9" in out or "Killed" in out), out
    kept = checkpoint_state(tmp_path / "run")["global_step"]
    assert kept == STEPS_PER_EPOCH, kept
    rc2, out2, _ = run(command(train_args(recipe, tmp_path / "run", "--resume"), ranks=2), 120)
    assert rc2 == 0 and f"at global step {STEPS_PER_EPOCH} (epoch 2, step 0 of it)" in out2, out2
    assert same_result(summary(tmp_path / "run"), reference(2)), (summary(tmp_path / "run"),
                                                                   reference(2))
    record(bound, t, rc, f"checkpoint at global step {kept}; resumed to the uninterrupted result")


GAN = textwrap.dedent("""
    import torch, hpclb
    comm = hpclb.init()
    disc, gen = torch.nn.Linear(4, 1), torch.nn.Linear(2, 4)
    d_opt = hpclb.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1), disc)
    try:
        g_opt = hpclb.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), gen)
    except ValueError as e:
        print(f"rank {comm.rank}: refused: {e}", flush=True)
        raise SystemExit(4)
    print(f"rank {comm.rank}: accepted a second DistributedOptimizer", flush=True)
""")


@pytest.mark.timeout(120)
def test_two_distributed_optimizers_on_one_communicator_refused(tmp_path, record):
    """A GAN's two DistributedOptimizers on one communicator (2 ranks): the second is refused on
    every rank with the message saying what to do, within 60 s, before any collective."""
    bound = 60
    script = tmp_path / "gan.py"
    script.write_text(GAN)
    rc, out, t = run([str(MPIRUN), "--bind-to", "none", "-n", "2", sys.executable, str(script)],
                     bound)
    assert rc == 4, out
    for r in (0, 1):
        assert f"rank {r}: refused: this communicator already carries" in out, out
    assert "two GradientSyncs on one communicator" in out and "with one GradientSync" in out, out
    record(bound, t, rc, "n/a (refused before any step)")
