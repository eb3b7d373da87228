"""Bad input through the real command line, 1 process and under mpirun with 2 ranks: every case
ends within seconds, non-zero, with a message naming the problem."""
import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers import LAUNCH_ENV, quick_recipe, run_hpclb


def hpclb(*args, ranks=1, timeout=120):
    """Run the CLI; a hang fails the test through ``timeout`` (seconds). Returns (rc, output,
    seconds)."""
    t = time.monotonic()
    p = run_hpclb(*args, ranks=ranks, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t


BAD_INPUT = [
    (["--batch-size", "1023"], "not divisible by the world size 2"),
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--lr", "-0.1"], "--lr: must be a positive finite number"),
    (["--lr", "inf"], "--lr: must be a positive finite number .*got inf"),
    (["--epochs", "0.001"], "warmup .* must be shorter than training"),
    (["--accumulation-steps", "0"], r"--accumulation-steps \(recipe field accumulation_steps\): "
     r"must be an integer >= 1"),
    (["--accumulation-steps", "3"], r"world size \d x --accumulation-steps 3 = \d .*; choose a "
     r"--batch-size that is a multiple"),
    (["--data-dir", "/nonexistent"], "no such file"),
]
# Every case at 1 process; under mpirun -n 2 the world-size cases and the data check in make
# test, the other 2-rank variants (the same validation code, ~4 s of launch each) in
# make test-extended.
_TWO_RANKS_IN_MAKE_TEST = (0, 6, 7)


@pytest.mark.parametrize("ranks,args,message", [
    *[(1, a, m) for a, m in BAD_INPUT],
    *[pytest.param(2, a, m, marks=[] if i in _TWO_RANKS_IN_MAKE_TEST else [pytest.mark.extended])
      for i, (a, m) in enumerate(BAD_INPUT)]])
def test_bad_input_fails_fast_with_a_message(tmp_path, mnist_dir, ranks, args, message):
    if ranks == 1 and "divisible" in message:
        args, message = ["--batch-size", "-5"], "--batch-size: must be a positive integer"
    if "--data-dir" not in args:
        args = [*args, "--data-dir", str(mnist_dir.parent)]
    rc, out, _ = hpclb("train", "mnist-lstm", "--out", str(tmp_path / "o"), *args, ranks=ranks)
    assert rc != 0, out
    assert re.search(message, out), out
    assert "epoch   1/" not in out  # failed before any rank started training


def test_unknown_experiment_lists_the_known_ones(tmp_path):
    rc, out, _ = hpclb("train", "mnist-gru", "--out", str(tmp_path))
    assert rc == 2 and "unknown experiment 'mnist-gru'" in out and "mnist-lstm" in out


def test_corrupt_data_file_fails_on_every_rank(tmp_path, mnist_dir):
    bad = tmp_path / "data" / "mnist"
    bad.mkdir(parents=True)
    for f in mnist_dir.glob("*-ubyte"):
        shutil.copy(f, bad / f.name)
    img = bad / "train-images-idx3-ubyte"
    img.write_bytes(img.read_bytes()[:1000])
    rc, out, _ = hpclb("train", "mnist-lstm", "--data-dir", str(tmp_path / "data"),
                          "--out", str(tmp_path / "o"), "--batch-size", "256", ranks=2)
    assert rc != 0 and "truncated or corrupt" in out and "epoch   1/" not in out, out


def test_recipe_errors_name_the_field(tmp_path):
    bad = quick_recipe(tmp_path, decay={"name": "poly", "powr": 2})
    rc, out, _ = hpclb("train", bad, "--out", str(tmp_path / "o"))
    assert rc == 2 and "decay" in out and "'powr'" in out, out
    bad = quick_recipe(tmp_path, optimizers={"adam": {"lr": -1}})
    rc, out, _ = hpclb("train", bad, "--out", str(tmp_path / "o"))
    assert rc == 2 and "optimizers.adam.lr" in out, out
    bad = quick_recipe(tmp_path, accumulation_steps=0)
    rc, out, _ = hpclb("train", bad, "--out", str(tmp_path / "o"))
    assert rc == 2 and "accumulation_steps (or --accumulation-steps): must be an integer >= 1" \
        in out, out


def test_expect_world_size_catches_a_lone_rank(tmp_path):
    rc, out, _ = hpclb("train", "mnist-lstm", "--expect-world-size", "2", "--out", str(tmp_path))
    assert rc == 2 and "world size 1" in out, out


def test_resume_without_checkpoint(tmp_path, mnist_dir):
    rc, out, _ = hpclb("train", "mnist-lstm", "--resume", "--out", str(tmp_path / "none"),
                       "--data-dir", str(mnist_dir.parent))
    assert rc != 0 and "no checkpoint to resume from" in out, out


# --- in process: cli.main(...) with the self communicator; fails before any work -----------------

@pytest.mark.parametrize("changes,message", [
    ({"data": "mnist"}, r"quick.yaml: data: must be a mapping .*`data: \{name: mnist\}`"),
    ({"optimizers": {"adam": 0.002}},
     r"quick.yaml: optimizers.adam: must be a mapping .*`optimizers: \{adam: \{lr: 0.002\}\}`"),
    ({"optimizers": ["adam"]}, r"quick.yaml: optimizers: must be a mapping"),
    ({"decay": "poly"}, r"quick.yaml: decay: must be a mapping .*`decay: \{name: poly"),
    ({"decay": {"name": "poly", "power": "2"}}, r"decay: poly power must be a finite number"),
    ({"model": "x"}, r"quick.yaml: model: must be a mapping .*`model: \{name: mnist_lstm"),
    ({"model": {"name": "mnist_lstm", "hiden_size": 64}},
     r"model.hiden_size: not an argument of model mnist_lstm \(did you mean 'hidden_size'\?\)"),
    ({"warmup_epochs": float("inf")}, r"quick.yaml: warmup_epochs: must be a finite number >= 0"),
    ({"warmup_epochs": "0.25"}, r"quick.yaml: warmup_epochs: must be a finite number >= 0"),
    ({"epochs": float("inf")}, r"quick.yaml: epochs: must be a finite number > 0"),
    ({"base_batch_size": 128.5}, r"quick.yaml: base_batch_size: must be a positive integer"),
    ({"name": ["x"]}, r"quick.yaml: name: must be a non-empty string"),
    ({"task": ["x"]}, r"quick.yaml: task: \['x'\] is not one of"),
    ({"optimizer": "lamb", "optimizers": {"adam": {"lr": 0.002}}},
     r"quick.yaml: optimizer: the default optimizer must be one of the recipe's optimizers"),
    ({"target": {"metric": "test_accuracy", "valu": 0.9}},
     r"target.valu: not a target field \(did you mean 'value'\?\)"),
    ({"grad_clip_nrom": 1.0},
     r"quick.yaml: grad_clip_nrom: not a recipe field \(did you mean 'grad_clip_norm'\?\)"),
    ({"accumulation_step": 2},
     r"quick.yaml: accumulation_step: not a recipe field \(did you mean 'accumulation_steps'\?\)"),
])
def test_recipe_of_the_wrong_shape_names_field_and_fix(tmp_path, in_process, changes, message):
    rc, err = in_process("train", quick_recipe(tmp_path, **changes), "--out", tmp_path / "o")
    assert rc == 2 and re.search(message, err), err
    assert err.count("hpclb: error:") == 1 and not (tmp_path / "o").exists()


def test_every_packaged_recipe_uses_only_known_fields(tmp_path):
    from hpclb.config import RECIPE_KEYS, available_experiments, load_recipe
    for name in available_experiments():
        assert set(load_recipe(name)) <= set(RECIPE_KEYS), name
    assert set(load_recipe(quick_recipe(tmp_path))) <= set(RECIPE_KEYS)


@pytest.mark.parametrize("args,message", [
    (["--checkpoint-interval", "-1"], r"--checkpoint-interval -1.0: must be a number of seconds "
     r">= 0 \(0: off"),
    (["--checkpoint-interval", "nan"], r"--checkpoint-interval nan: must be"),
    (["--expect-world-size", "0"], r"--expect-world-size 0: must be an integer >= 1"),
    (["--expect-world-size", "-2"], r"--expect-world-size -2: must be an integer >= 1"),
    (["--epochs", "inf"], r"--epochs: must be a finite number > 0"),
    (["--seed", "-1"], r"--seed: must be in \[0, 2\*\*32 - 1 = 4294967295\], got -1"),
    (["--seed", "99999999999999999999"], r"--seed: must be in \[0, 2\*\*32 - 1"),  # was a crash
])
def test_bad_flags_fail_in_process(tmp_path, in_process, args, message):
    rc, err = in_process("train", quick_recipe(tmp_path), "--out", tmp_path / "o",
                         "--data-dir", tmp_path / "nowhere", *args)  # fails before reading data
    assert rc == 2 and re.search(message, err), err


def test_checkpoint_interval_zero_means_off():
    from hpclb.config import check_checkpoint_interval
    from hpclb.errors import ConfigError
    assert check_checkpoint_interval(0) == 0 and check_checkpoint_interval(None) is None
    assert check_checkpoint_interval(1800.0) == 1800.0
    with pytest.raises(ConfigError, match="--checkpoint-interval"):
        check_checkpoint_interval(-0.5)


def test_batch_larger_than_the_training_set(tmp_path, in_process, mnist_dir):
    recipe = quick_recipe(tmp_path)  # 4,096 training images
    rc, err = in_process("train", recipe, "--out", tmp_path / "o", "--batch-size", 8192,
                         "--data-dir", mnist_dir.parent)
    assert rc == 2, err
    assert re.search(r"--batch-size 8192: the global batch is larger than the training set "
                     r"\(4096 samples of mnist\).*k = B / B0 = 64; use --batch-size 4096 or less",
                     err), err
    assert "shorter than training" not in err and not (tmp_path / "o").exists()


def test_warmup_message_names_the_command_line_fixes(tmp_path, mnist_dir):
    from hpclb.config import resolve
    from hpclb.errors import ConfigError
    recipe = quick_recipe(tmp_path)  # 4,096 images, B0 128, warmup 0.25 epochs = 8 steps
    with pytest.raises(ConfigError) as e:
        resolve(recipe, batch_size=256, epochs=0.3).schedule(4096)  # 16 steps/epoch, warmup 8
    msg = str(e.value)
    assert re.search(r"warmup \(8 steps.*must be shorter than training \(5 steps", msg), msg
    assert "train more epochs (--epochs, at least 0.563 for this batch)" in msg, msg
    assert "use a smaller --batch-size" in msg and "shorten the recipe's warmup_epochs" in msg
    resolve(recipe, batch_size=256, epochs=0.563).schedule(4096)  # the bound it names works
    with pytest.raises(ConfigError) as e:  # fixed-epoch warmup: a smaller batch does not help
        resolve(recipe, batch_size=256, epochs=0.1, scaling="linear").schedule(4096)
    assert "--epochs 0.1: the recipe's warmup" in str(e.value)  # refused before the data
    assert "smaller --batch-size" not in str(e.value) and "train more than 0.25" in str(e.value)
    assert "more at a larger batch with --scaling legw: its warmup is 0.25 x k epochs" in \
        str(e.value)  # the B0 bound is not the whole story (fresh-user review)
    with pytest.raises(ConfigError) as e:  # goyal's 5 epochs: the recipe's warmup is no fix
        resolve(recipe, batch_size=256, epochs=2, scaling="goyal").schedule(4096)
    assert "or use another --scaling (goyal's warmup is a fixed 5 epochs" in str(e.value)
    assert "warmup_epochs)" in str(e.value) and "shorten the recipe's" not in str(e.value)


# --- help without torch: the parser is built from name lists, each command's only when run --

_HELP_CODE = ("import sys\nfrom hpclb.cli import main\ntry:\n    main(sys.argv[1:])\n"
              "except SystemExit as e:\n    assert e.code == 0, e.code\n"
              "assert 'torch' not in sys.modules, 'torch was imported'\n")


@pytest.mark.parametrize("argv", [
    ["--help"], ["advise", "--help"], ["train", "--help"], ["jobs", "render", "--help"],
    ["data", "fetch", "--help"], ["evaluate", "--help"], ["sweep", "--help"],
    ["scale", "--help"], ["plot", "runs", "--help"], ["jobs", "examples", "--help"],
    ["compare", "--help"], ["doctor", "--help"],
], ids=" ".join)
def test_help_does_not_import_torch(argv):
    """`hpclb --help` and a command's --help print without loading torch (seconds of start-up,
    and the signal handlers must be in before anything heavy)."""
    r = subprocess.run([sys.executable, "-c", _HELP_CODE, *argv], capture_output=True,
                       text=True, timeout=120, env=LAUNCH_ENV)
    assert r.returncode == 0, r.stderr
    assert "usage: hpclb" in r.stdout


# --- the exit status of an exception (hpclb.errors: exit_code, agreed) --------------------------

class _FakeComm:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.aborted = rank, world_size, None

    def abort(self, code: int) -> None:
        self.aborted = code


@pytest.mark.parametrize("error,code", [
    ("ConfigError", 2), ("ModelMismatchError", 2), ("AgreedFailure", 1), ("Diverged", 3)])
@pytest.mark.parametrize("rank", [0, 1])
def test_agreed_errors_are_printed_by_rank_0_without_abort(capsys, error, code, rank):
    from hpclb import errors
    from hpclb.cli.common import exit_status

    comm = _FakeComm(rank, 2)
    assert exit_status(getattr(errors, error)("bad thing"), comm) == code
    assert comm.aborted is None
    assert capsys.readouterr().err == ("hpclb: error: bad thing\n" if rank == 0 else "")


@pytest.mark.parametrize("world_size", [1, 2])
def test_other_errors_are_printed_by_their_rank_which_aborts(capsys, monkeypatch, world_size):
    from hpclb.cli.common import exit_status
    from hpclb.errors import DataError

    monkeypatch.delenv("HPCLB_TRACEBACK", raising=False)
    comm = _FakeComm(world_size - 1, world_size)
    for e in (DataError("truncated"), OSError("disk full")):
        assert exit_status(e, comm) == 1
        where = " on rank 1 of 2" if world_size == 2 else ""
        assert capsys.readouterr().err == f"hpclb: error: {type(e).__name__}{where}: {e}\n"
        assert comm.aborted == (1 if world_size == 2 else None)
    monkeypatch.setenv("HPCLB_TRACEBACK", "1")
    with pytest.raises(KeyError):
        exit_status(KeyError("x"), comm)


def test_parser_of_one_command_lists_the_others_by_name():
    from hpclb.cli import COMMANDS, build_parser

    full, one = build_parser(), build_parser(only="advise")
    assert full.format_help() == one.format_help()
    assert one.parse_args(["advise", "run", "--last", "2"]).last == 2
    assert set(COMMANDS) == {"train", "evaluate", "sweep", "compare", "data", "jobs", "bench",
                             "plot", "scale", "advise", "doctor"}


def test_warmup_check_uses_the_epochs_of_the_command_line(tmp_path):
    """The recipe's warmup is compared with the run's budget: ``--epochs`` when given (a recipe
    whose own ``epochs`` is shorter than its warmup trains with a longer --epochs; a --epochs
    shorter than the warmup is refused naming --epochs, before any data is read)."""
    from hpclb.config import resolve
    from hpclb.errors import ConfigError
    short = quick_recipe(tmp_path, epochs=0.2)  # warmup_epochs 0.25 > the recipe's 0.2 epochs
    with pytest.raises(ConfigError, match=r"quick.yaml: warmup_epochs: 0.25 epochs of warmup"):
        resolve(short)
    assert resolve(short, epochs=2).epochs == 2.0  # --epochs 2: longer than the warmup
    with pytest.raises(ConfigError) as e:
        resolve(quick_recipe(tmp_path), epochs=0.2)  # the recipe's 1 epoch would pass
    assert re.search(r"--epochs 0.2: the recipe's warmup \(quick.yaml: warmup_epochs 0.25, at "
                     r"base_batch_size\) must be shorter than training \(0.2 epochs\); train "
                     r"more than 0.25 epochs", str(e.value)), e.value
    with pytest.raises(ConfigError, match=r"--epochs: must be a finite number > 0, got -1"):
        resolve(short, epochs=-1)


def test_a_dry_run_into_head_ends_quietly():
    """`hpclb train ... --dry-run | head -1` printed `hpclb: error: BrokenPipeError` and exit 1:
    the reader leaving is not an error of the run (status 141, as for SIGPIPE; no message).
    Here the reader has left before the first line (a pipe whose read end is closed)."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "hpclb", "train", "mnist-lstm", "--dry-run"],
                           stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                           env=LAUNCH_ENV)
    finally:
        os.close(write)
    assert r.returncode == 141 and "error" not in r.stderr, (r.returncode, r.stderr[-2000:])
