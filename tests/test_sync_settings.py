"""The gradient-sync settings of `hpclb train`, declared once (hpclb/config/fields.py,
SYNC_SETTINGS): the recipe's `sync:` section, the `HPCLB_*` variables as overrides applied once
at resolution, the flags over both; each bad value names where it came from."""
import json
import re
from pathlib import Path

import pytest
from helpers import LAUNCH_ENV, quick_recipe, run_hpclb

from hpclb.config import ConfigError, resolve
from hpclb.config.fields import SYNC_SETTINGS, resolve_sync


@pytest.fixture(autouse=True)
def _no_sync_environment(monkeypatch):
    for s in SYNC_SETTINGS.values():
        monkeypatch.delenv(s.env, raising=False)


def test_defaults_are_hpclb_trains():
    assert resolve_sync(None, {}, {}, "r") == {
        "fusion_threshold_bytes": 25 * 2 ** 20, "overlap": "auto", "compression": "none",
        "stall_timeout_s": 60.0, "stall_abort_s": 600.0}


def test_flag_over_variable_over_recipe_over_default():
    section = {"compression": "bf16", "fusion_threshold_bytes": "4MiB", "stall_abort_s": "never"}
    env = {"HPCLB_COMPRESSION": "fp16", "HPCLB_OVERLAP": "none"}
    got = resolve_sync(section, {"overlap": "thread"}, env, "r")
    assert got["overlap"] == "thread"                    # flag over $HPCLB_OVERLAP
    assert got["compression"] == "fp16"                  # $HPCLB_COMPRESSION over the recipe
    assert got["fusion_threshold_bytes"] == 4 * 2 ** 20  # the recipe over the default
    assert got["stall_abort_s"] is None                  # never
    assert got["stall_timeout_s"] == 60.0                # the default


@pytest.mark.parametrize("section,given,env,message", [
    ({"compression": "fp8"}, {}, {}, r"r: sync.compression: must be one of none, fp16, "
                                     r"bf16.*got 'fp8'"),
    ({}, {"fusion_threshold_bytes": "25 parsecs"}, {}, r"--fusion-threshold: must be a size"),
    # past a float: named, not an OverflowError (found by a fresh-user review)
    ({}, {"fusion_threshold_bytes": "1e400"}, {}, r"--fusion-threshold: must be a size"),
    ({}, {}, {"HPCLB_FUSION_THRESHOLD_BYTES": "1e400"},
     r"\$HPCLB_FUSION_THRESHOLD_BYTES: must be a size"),
    ({"fusion_threshold_bytes": float("inf")}, {}, {}, r"r: sync.fusion_threshold_bytes: must"),
    ({}, {}, {"HPCLB_STALL_TIMEOUT_S": "-1"}, r"\$HPCLB_STALL_TIMEOUT_S: must be a number of "
                                              r"seconds > 0"),
    ({"stall_abort_s": 30}, {}, {}, r"r: sync.stall_abort_s 30 is below the default of "
                                    r"--stall-timeout 60"),
    ({"stall_abort_s": 100}, {"stall_timeout_s": "200"}, {},
     r"r: sync.stall_abort_s 100 is below --stall-timeout 200"),
])
def test_a_bad_value_names_its_source(section, given, env, message):
    with pytest.raises(ConfigError, match=message):
        resolve_sync(section, given, env, "r")


@pytest.mark.parametrize("sync,message", [
    ({"overlapp": "thread"}, r"sync.overlapp: not a gradient-sync setting; they are "
                             r"fusion_threshold_bytes, overlap"),
    ("fp16", r"sync: must be a mapping"),
    ({"stall_timeout_s": 0}, r"sync.stall_timeout_s: must be a number of seconds > 0"),
])
def test_the_recipe_section_is_checked_when_it_is_loaded(tmp_path, sync, message):
    with pytest.raises(ConfigError, match=message):
        resolve(quick_recipe(tmp_path, sync=sync))


def test_an_abort_below_the_timeout_names_the_recipe_file(tmp_path):
    # the recipe's own file, as every other recipe error names it (review finding: it named the
    # recipe's `name:` field, which need not match any file)
    path = quick_recipe(tmp_path, sync={"stall_abort_s": 5})
    with pytest.raises(ConfigError, match=rf"^{re.escape(Path(path).name)}: sync.stall_abort_s 5 "
                                          r"is below the default of --stall-timeout 60"):
        resolve(path)


def test_resolve_applies_the_variables_once(tmp_path, monkeypatch):
    """RunConfig.sync holds the values in force; GradientSync gets them as arguments, so it
    never reads $HPCLB_* again for a run of hpclb train."""
    monkeypatch.setenv("HPCLB_FUSION_THRESHOLD_BYTES", "1MiB")
    cfg = resolve(quick_recipe(tmp_path, sync={"fusion_threshold_bytes": "8MiB",
                                               "overlap": "nonblocking"}),
                  sync={"stall_timeout_s": "30"})
    assert cfg.sync == {"fusion_threshold_bytes": 2 ** 20, "overlap": "nonblocking",
                        "compression": "none", "stall_timeout_s": 30.0, "stall_abort_s": 600.0}


def test_a_run_records_the_recipes_sync_section_with_overrides(tmp_path, mnist_dir):
    """`hpclb train` with a recipe's `sync:` section, an HPCLB_* variable and a flag: config.json
    records the values in force, each from the source that wins."""
    recipe = quick_recipe(tmp_path, data={"name": "mnist", "train_samples": 1024,
                                          "test_samples": 500},
                          sync={"compression": "bf16", "stall_abort_s": "never",
                                "fusion_threshold_bytes": "2MiB"})
    env = {**LAUNCH_ENV, "HPCLB_COMPRESSION": "fp16"}
    p = run_hpclb("train", recipe, "--out", tmp_path / "run", "--data-dir", mnist_dir.parent,
                  "--overlap", "nonblocking", env=env, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    sync = json.loads((tmp_path / "run" / "config.json").read_text())["sync"]
    assert (sync["compression"], sync["overlap_setting"], sync["stall_abort_s"],
            sync["fusion_threshold_bytes"]) == ("fp16", "nonblocking", None, 2 * 2 ** 20), sync
    bad = run_hpclb("train", recipe, "--out", tmp_path / "bad", "--data-dir", mnist_dir.parent,
                    "--compression", "fp8", timeout=120)
    assert bad.returncode == 2 and "--compression: must be one of none, fp16, bf16" in \
        bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()


def test_ranks_compare_each_sync_setting_by_its_flag(tmp_path):
    """The ranks' settings agreement (hpclb/config/agreement.py) names each gradient-sync
    setting by its flag, so ranks given different --compression stop with exit 2 naming it."""
    from hpclb.config.agreement import _canonical, _mismatch_message, run_settings

    recipe = quick_recipe(tmp_path)
    a = run_settings(resolve(recipe, sync={"compression": "fp16"}))
    b = run_settings(resolve(recipe, sync={"compression": "bf16"}))
    assert a["sync.compression (--compression)"] == "fp16"
    message = _mismatch_message([_canonical(a), _canonical(b)])
    assert "sync.compression (--compression) is" in message and "bf16" in message, message


def test_a_tiny_fusion_threshold_warns_naming_every_place_it_is_set():
    """The unit hint names the flag, the variable and the recipe (it named only the variable,
    whichever had set it; fresh-user review)."""
    from hpclb.sync.options import SyncOptions

    with pytest.warns(UserWarning, match=r"one bucket per tensor.*--fusion-threshold, "
                                         r"\$HPCLB_FUSION_THRESHOLD_BYTES, the recipe's sync:"):
        SyncOptions.resolve(fusion_threshold_bytes=100)
