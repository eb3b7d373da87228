"""Fault matrix, preemption: SIGUSR2 and SIGTERM to one rank of 2 at start-up (0.3 s after its
launch), mid-epoch (global step 11), and while rank 0 writes the epoch-1 checkpoint. Every rank
exits 75 within the bound; the checkpoint holds every step taken; --resume (run for USR2; TERM
reaches the same handler and checkpoint) ends at the uninterrupted run's result."""
import pytest
from conftest import (
    checkpoint_state,
    command,
    run,
    same_result,
    summary,
    train_args,
    write_recipe,
)

BLOCK = ["env", "--block-signal=USR2", "--block-signal=TERM"]  # as the job templates launch
START_UP = "preempted during start-up, before training began; no new checkpoint; exit 75"


def resume_matches_reference(recipe, out, reference) -> None:
    rc, text, _ = run(command(train_args(recipe, out, "--resume"), ranks=2), 120)
    assert rc == 0 and "resumed from" in text, text
    assert same_result(summary(out), reference(2)), (summary(out), reference(2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["USR2", "TERM"])
def test_signal_at_start_up(tmp_path, sig, record):
    """Rank 1 gets the signal 0.3 s after its launch (blocked until hpclb's handler is in place,
    as the job templates start ranks): both ranks exit 75 within 60 s, no checkpoint yet, no
    summary (the requeued job starts afresh: nothing was lost)."""
    bound = 60
    rank_cmd = (f'[ "$OMPI_COMM_WORLD_RANK" = 1 ] && (sleep 0.3; kill -{sig} $$) & '
                f'exec "$@"')
    cmd = command(train_args(write_recipe(tmp_path), tmp_path / "run"), ranks=2,
                  wrap=[*BLOCK, "bash", "-c", rank_cmd, "bash"])
    rc, out, t = run(cmd, bound)
    assert rc == 75, out
    if START_UP in out:  # the usual case: the signal comes long before torch is imported
        assert f"rank 0 of 2: {START_UP}" in out and f"rank 1 of 2: {START_UP}" in out, out
        assert not (tmp_path / "run" / "checkpoint.pt").exists()
        kept = "nothing to keep (before the model existed)"
    else:  # a slow machine: it came after the first step, which was checkpointed
        assert "preempted: checkpoint of global step 1 " in out, out
        kept = f"checkpoint at global step {checkpoint_state(tmp_path / 'run')['global_step']}"
    assert not (tmp_path / "run" / "summary.json").exists()
    record(bound, t, rc, kept)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", ["USR2", "TERM"])
def test_signal_mid_epoch(tmp_path, sig, reference, record):
    """Rank 1 gets the signal during global step 11 (epoch 2): every rank exits 75 within 60 s
    after checkpointing step 11; --resume reaches the uninterrupted result."""
    bound = 60
    recipe, out = write_recipe(tmp_path), tmp_path / "run"
    rc, text, t = run(command(train_args(recipe, out), ranks=2), bound,
                      env={"FAULT_MODE": "signal", "FAULT_RANK": "1", "FAULT_STEP": "11",
                           "FAULT_SIGNAL": f"SIG{sig}"})
    assert rc == 75, text
    assert "preempted: checkpoint of global step 11 (epoch 2, step 3/8)" in text, text
    assert "rank 1 of 2: preempted after step 11, checkpoint saved; exit 75" in text, text
    assert not (out / "summary.json").exists()
    assert checkpoint_state(out)["global_step"] == 11
    if sig == "USR2":
        resume_matches_reference(recipe, out, reference)
    record(bound, t, rc, "checkpoint at global step 11 (the signal's step)" +
           ("; resumed to the uninterrupted result" if sig == "USR2" else ""))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", ["USR2", "TERM"])
def test_signal_during_checkpoint_write(tmp_path, sig, reference, record):
    """Rank 0 gets the signal while it writes the epoch-1 checkpoint (step 8): the write
    completes and verifies, the ranks stop after the next step (9) with its checkpoint, exit 75
    within 60 s; --resume reaches the uninterrupted result."""
    bound = 60
    recipe, out = write_recipe(tmp_path), tmp_path / "run"
    rc, text, t = run(command(train_args(recipe, out), ranks=2, hooked=True), bound,
                      env={"HOOK_MODE": "signal", "HOOK_SAVE": "1", "HOOK_SIGNAL": sig})
    assert rc == 75, text
    assert "preempted: checkpoint of global step 9 (epoch 2, step 1/8)" in text, text
    from hpclb.train.checkpoint import CheckpointStore, load_checkpoint
    steps = [load_checkpoint(p)["global_step"] for _, _, p in CheckpointStore(out).generations()]
    assert steps == [8, 9], steps  # the interrupted write is whole and verifies
    if sig == "USR2":
        resume_matches_reference(recipe, out, reference)
    record(bound, t, rc, "checkpoints at global steps 8 (written during the signal) and 9" +
           ("; resumed to the uninterrupted result" if sig == "USR2" else ""))
