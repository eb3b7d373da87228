"""Recipe settings (hpclb/config.py): duplicate keys, ranges with units, and the run settings a
recipe sets and the command line overrides (device, precision, log_every, noise_scale,
max_nonfinite_steps, keep_checkpoints)."""
import re
import warnings

import pytest
from helpers import quick_recipe

from hpclb.config import SETTINGS, load_recipe, resolve
from hpclb.errors import ConfigError, RecipeWarning

pytestmark = pytest.mark.timeout(60)

RECIPE = """\
name: dup
data: {name: mnist}
model: {name: mnist_lstm, hidden_size: 16}
base_batch_size: 128
epochs: 1
warmup_epochs: 0.25
decay: {name: poly, power: 2.0}
optimizer: adam
optimizers:
  adam: {lr: 0.002}
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


def test_duplicate_top_level_key_names_key_and_lines(tmp_path):
    with pytest.raises(ConfigError, match=r"r.yaml: line 11: key 'epochs' is written twice in "
                       r"one mapping \(first at line 5\); YAML would keep only the last value"):
        load_recipe(write(tmp_path, RECIPE + "epochs: 20\n"))


def test_duplicate_nested_key_is_rejected_but_merge_keys_may_override(tmp_path):
    nested = RECIPE.replace("adam: {lr: 0.002}", "adam:\n    lr: 0.002\n    lr: 0.02")
    with pytest.raises(ConfigError, match=r"line 12: key 'lr' is written twice .*first at "
                       r"line 11"):
        load_recipe(write(tmp_path, nested))
    merged = RECIPE.replace("adam: {lr: 0.002}", "adam: &a {lr: 0.002}\n  lamb: {<<: *a, lr: "
                            "0.001}")
    assert load_recipe(write(tmp_path, merged))["optimizers"]["lamb"] == {"lr": 0.001}


@pytest.mark.parametrize("changes,message", [
    ({"warmup_epochs": 1}, r"warmup_epochs: 1 epochs of warmup \(at base_batch_size\) is not "
     r"shorter than training \(epochs: 1\)"),
    ({"optimizers": {"adam": {"lr": 0}}}, r"optimizers.adam.lr: must be a positive learning "
     r"rate \(the peak LR at base_batch_size, per optimizer step\), got 0"),
    ({"optimizers": {"adam": {"lr": 0.1, "eps": 0}}}, r"optimizers.adam.eps: must be a number > "
     r"0 \(added to a denominator; 0 gives 0/0 = NaN"),
    ({"optimizers": {"adam": {"lr": 0.1, "betas": [0.9, 1.0]}}}, r"optimizers.adam.betas: must "
     r"be two numbers in \[0, 1\)"),
    ({"optimizers": {"adam": {"lr": 0.1}, "momentum": {"lr": 0.1, "momentum": 1.0}}},
     r"optimizers.momentum.momentum: must be a number in \[0, 1\), got 1.0"),
    ({"optimizers": {"adam": {"lr": 0.1, "weight_decay": -1e-4}}},
     r"optimizers.adam.weight_decay: must be a number >= 0"),
    ({"optimizers": {"adam": {"lr": 0.1}, "lars": {"lr": 1, "trust_coefficient": 0}}},
     r"optimizers.lars.trust_coefficient: must be a number > 0"),
    ({"grad_clip_norm": 0}, r"grad_clip_norm: must be null or > 0 \(the largest global L2 norm "
     r"of the averaged gradient\)"),
    ({"target": {"metric": "test_accuracy", "value": 98}}, r"target.value: 98: an accuracy is a "
     r"fraction in \[0, 1\] \(0.98 for 98%\)"),
    ({"data": {"name": "mnist", "train_samples": 0}}, r"data.train_samples: must be a positive "
     r"integer \(the first N samples"),
])
def test_settings_out_of_range_are_rejected_with_their_unit(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=r"quick.yaml: " + message):
        load_recipe(quick_recipe(tmp_path, **changes))


def test_values_outside_the_sensible_range_warn(tmp_path):
    with pytest.warns(RecipeWarning, match=r"optimizers.adam.lr: learning rate 1e\+06 is above "
                      r"1000"):
        load_recipe(quick_recipe(tmp_path, optimizers={"adam": {"lr": 1e6}}))
    with pytest.warns(RecipeWarning, match=r"weight_decay 2 is >= 1"):
        load_recipe(quick_recipe(tmp_path, optimizers={"adam": {"lr": 0.1, "weight_decay": 2}}))
    with pytest.warns(RecipeWarning, match=r"--lr: learning rate 5000 is above 1000"):
        resolve(quick_recipe(tmp_path), lr=5000.0)
    with pytest.warns(RecipeWarning, match=r"--max-nonfinite-steps \(recipe field "
                      r"max_nonfinite_steps\): 500 is above 100"):
        resolve(quick_recipe(tmp_path), max_nonfinite_steps=500)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the packaged recipe's values are all in range
        resolve("mnist-lstm", lr=2.0)


def test_run_settings_default_recipe_and_command_line(tmp_path):
    cfg = resolve(quick_recipe(tmp_path))
    assert (cfg.device, cfg.precision, cfg.log_every, cfg.noise_scale, cfg.max_nonfinite_steps,
            cfg.keep_checkpoints) == ("auto", "fp32", 50, False, 3, 2)
    assert {k: v[0] for k, v in SETTINGS.items()} == {
        "accumulation_steps": 1, "device": "auto", "precision": "fp32", "log_every": 50,
        "noise_scale": False, "max_nonfinite_steps": 3, "keep_checkpoints": 2}
    recipe = quick_recipe(tmp_path, device="cpu", precision="bf16", log_every=0,
                          noise_scale=True, max_nonfinite_steps=1, keep_checkpoints=5)
    cfg = resolve(recipe)
    assert (cfg.device, cfg.precision, cfg.log_every, cfg.noise_scale, cfg.max_nonfinite_steps,
            cfg.keep_checkpoints) == ("cpu", "bf16", 0, True, 1, 5)
    cfg = resolve(recipe, device="cuda", precision="fp16", log_every=10, noise_scale=False,
                  max_nonfinite_steps=7, keep_checkpoints=1)  # the command line wins
    assert (cfg.device, cfg.precision, cfg.log_every, cfg.noise_scale, cfg.max_nonfinite_steps,
            cfg.keep_checkpoints) == ("cuda", "fp16", 10, False, 7, 1)
    saved = cfg.to_dict()  # config.json
    assert saved["precision"] == "fp16" and saved["keep_checkpoints"] == 1


@pytest.mark.parametrize("key,bad,message", [
    ("device", "gpu", r"must be one of auto, cpu, cuda \(auto: cuda when a GPU is visible"),
    ("precision", "fp8", r"must be one of fp32, bf16, fp16"),
    ("log_every", -1, r"must be an integer >= 0 \(optimizer steps between progress lines; 0: "
     r"off\)"),
    ("log_every", 2.5, r"must be an integer >= 0"),
    ("noise_scale", "yes", r"must be true or false"),
    ("max_nonfinite_steps", 0, r"must be an integer >= 1 \(consecutive optimizer steps with a "
     r"non-finite loss or gradient"),
    ("keep_checkpoints", 0, r"must be an integer >= 1 \(checkpoint generations kept"),
    ("keep_checkpoints", True, r"must be an integer >= 1"),
    ("accumulation_steps", 0, r"must be an integer >= 1 \(micro-batches per optimizer step; "
     r"1: no accumulation\)"),
    ("accumulation_steps", 2.0, r"must be an integer >= 1"),
])
def test_bad_run_setting_names_flag_and_recipe_field(tmp_path, key, bad, message):
    flag = SETTINGS[key][1]
    with pytest.raises(ConfigError, match=rf"quick.yaml: {key} \(or {flag}\): {message}.*, got "
                       rf"{re.escape(repr(bad))}$"):
        load_recipe(quick_recipe(tmp_path, **{key: bad}))
    with pytest.raises(ConfigError, match=rf"^{flag} \(recipe field {key}\): {message}"):
        resolve(quick_recipe(tmp_path), **{key: bad})


def test_metric_direction_is_decided_in_one_place():
    from hpclb.tasks.spec import metric_mode
    from hpclb.tools.sweep import metric_of

    assert [metric_mode(m) for m in ("test_loss", "valid_perplexity", "top1_error",
                                     "test_accuracy", "test_bleu")] == ["min"] * 3 + ["max"] * 2
    assert metric_of({"target": {"metric": "valid_perplexity"}}) == ("valid_perplexity", "min")
    assert metric_of({"target": {"metric": "valid_perplexity", "mode": "max"}})[1] == "max"
    assert metric_of({}) == ("test_accuracy", "max")
