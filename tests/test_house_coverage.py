"""Every hpclb module is inside every house check's file list (``make lint``).

ruff skips folders named ``dist``/``build`` by default and an unanchored exclude (``"data"``)
drops every folder of that name, packages included: a check that skips files passes for the
wrong reason. These tests ask each tool which files it would read and compare with the tree.
"""
from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hpclb"
BIN = Path(sys.executable).parent


def _modules() -> set[Path]:
    found = {p.resolve() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert len(found) > 100, f"only {len(found)} modules under {PACKAGE}"
    return found


def _tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed beside {sys.executable}: run `make install`")
    return path


def test_ruff_reads_every_module():
    out = subprocess.run([str(_tool("ruff")), "check", "--show-files", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    read = {Path(line.strip()).resolve() for line in out.splitlines() if line.strip()}
    missing = sorted(str(p.relative_to(ROOT)) for p in _modules() - read)
    assert not missing, f"ruff skips {len(missing)} modules (an exclude matches them): {missing}"


def test_vulture_reads_every_module(monkeypatch):
    from vulture import config, core

    with open(ROOT / "pyproject.toml", "rb") as toml:
        settings = config.make_config([], tomlfile=toml)
    read: set[Path] = set()
    monkeypatch.setattr(core.Vulture, "scan",
                        lambda self, code, filename="": read.add(Path(filename).resolve()))
    monkeypatch.chdir(ROOT)
    core.Vulture().scavenge(settings["paths"], exclude=settings["exclude"])
    missing = sorted(str(p.relative_to(ROOT)) for p in _modules() - read)
    assert not missing, f"vulture skips {len(missing)} modules: {missing}"


def test_import_contract_names_every_top_level_module():
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    layers = parser["importlinter:contract:layers"]["layers"]
    named = {name.strip() for line in layers.splitlines() for name in line.split("|")
             if name.strip()}
    top = {f"hpclb.{p.stem}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    top |= {f"hpclb.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")}
    missing = sorted(top - named)
    assert not missing, f".importlinter's layers do not name {missing}: nothing checks them"
    # grimp (import-linter's graph) sees only modules inside packages
    outside = sorted(str(p.relative_to(ROOT)) for p in _modules()
                     if not all((d / "__init__.py").exists()
                                for d in p.parents if d.is_relative_to(PACKAGE)))
    assert not outside, f"modules outside any package (import-linter never sees them): {outside}"


def test_house_check_reads_every_module():
    sys.path.insert(0, str(ROOT / "dev"))
    try:
        import check_house
    finally:
        sys.path.remove(str(ROOT / "dev"))
    read = {p.resolve() for p in check_house.source_files(PACKAGE)}
    missing = sorted(str(p.relative_to(ROOT)) for p in _modules() - read)
    assert not missing, f"dev/check_house.py skips {missing}"
