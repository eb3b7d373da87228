"""YAML 1.2 numbers in a recipe: ``lr: 2e-2`` (no dot) is a float, as in YAML 1.2 and JSON;
PyYAML's YAML 1.1 rules alone read it as the string '2e-2'."""
from __future__ import annotations

from importlib import resources

import pytest

from hpclb.config import load_recipe


def _recipe(tmp_path, lr: str) -> str:
    text = (resources.files("hpclb.experiments") / "mnist_lstm.yaml").read_text()
    path = tmp_path / "r.yaml"
    path.write_text(text.replace("adam: {lr: 2.0e-3}", f"adam: {{lr: {lr}}}"))
    return str(path)


@pytest.mark.parametrize("lr, value", [("2e-2", 0.02), ("1E-3", 0.001), ("+5e-4", 5e-4),
                                       ("2.0e-3", 0.002), ("0.01", 0.01)])
def test_exponent_without_dot_is_a_float(tmp_path, lr, value):
    recipe = load_recipe(_recipe(tmp_path, lr))
    assert recipe["optimizers"]["adam"]["lr"] == value
    assert isinstance(recipe["optimizers"]["adam"]["lr"], float)


def test_words_stay_strings(tmp_path):
    path = tmp_path / "r.yaml"
    text = (resources.files("hpclb.experiments") / "mnist_lstm.yaml").read_text()
    path.write_text(text.replace("name: mnist-lstm", "name: e2"))
    assert load_recipe(str(path))["name"] == "e2"
