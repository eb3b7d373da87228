"""Plug-in models and data sets, named in a recipe as ``package.module:attribute``.

A recipe's ``model.name`` or ``data.name`` may name a Python object instead of a built-in
model or data set (docs/plugins.md):

- ``model.name: my_models:MLP``: an ``nn.Module`` class, or a factory returning one; the
  ``model`` section's other keys are its keyword arguments;
- ``data.name: my_data:digits``: a function ``f(data_dir: str, **data_kwargs) -> (train, test)``
  returning two torch ``Dataset``s of ``(x, y)`` pairs (``y`` an integer class label); the
  ``data`` section's other keys (except ``train_samples``/``test_samples``) are its keyword
  arguments.

The module is imported from the current directory, the recipe file's directory (and the
recipe's ``plugin_path`` directories), then the installed packages. Every failure is a
:class:`hpclb.config.ConfigError` naming the recipe field and why: the module is not found,
importing it raised, the attribute is missing, it is not callable, or a keyword argument is not
one it takes.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from hpclb._io import sha256_file
from hpclb.errors import ConfigError

__all__ = ["Registry", "add_search_path", "check_kwargs", "check_no_bool_numbers", "is_plugin",
           "load_object", "resolve_ref", "signature_of", "source_digests", "takes_number"]


def is_plugin(name: Any) -> bool:
    """Whether a recipe's ``model.name``/``data.name`` is a ``package.module:attribute``."""
    return isinstance(name, str) and ":" in name


def add_search_path(dirs: Iterable[str | os.PathLike]) -> None:
    """Make modules in ``dirs`` (and the current directory) importable by plug-in names: each is
    put first on ``sys.path`` once, as ``python script.py`` puts the script's directory."""
    for d in [os.getcwd(), *dirs][::-1]:
        d = str(Path(d).resolve())
        if d not in sys.path:
            sys.path.insert(0, d)


def _split(spec: str, field: str) -> tuple[str, str]:
    module, _, attr = spec.partition(":")
    if module.endswith(".py") or "/" in module or "\\" in module:
        raise ConfigError(f"{field}: {spec!r} is not a plug-in name; write it as "
                          f"package.module:attribute with the module as Python imports it "
                          f"(my_models, not my_models.py or a path), e.g. my_models:MLP")
    ok = all(p.isidentifier() for p in module.split(".")) and \
        all(p.isidentifier() for p in attr.split("."))
    if not ok:
        raise ConfigError(f"{field}: {spec!r} is not a plug-in name; write it as "
                          f"package.module:attribute, e.g. my_models:MLP (a module my_models.py "
                          f"beside the recipe or on the Python path, and an attribute in it)")
    return module, attr


def _import(module: str, spec: str, field: str):
    importlib.invalidate_caches()  # a module written since the directory was last listed
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise ConfigError(
                f"{field}: {spec!r}: module {module!r} not found (looked in the current "
                f"directory {os.getcwd()}, the recipe's directory and plugin_path, and the "
                f"installed packages); put {module.replace('.', '/')}.py beside the recipe, "
                f"or install its package, or add its directory to the recipe's plugin_path"
            ) from e
        raise ConfigError(f"{field}: {spec!r}: importing module {module!r} failed: {e} (a "
                          f"module it imports is missing; install it)") from e
    except Exception as e:  # noqa: BLE001 -- any error in the user's module, reported as such
        raise ConfigError(f"{field}: {spec!r}: importing module {module!r} raised "
                          f"{type(e).__name__}: {e}") from e


def load_object(spec: str, field: str) -> Callable:
    """The callable named by ``spec`` (``package.module:attribute``, attribute may be dotted).

    ``field`` (e.g. ``"model.name"``) prefixes every error. Raises ConfigError: malformed name,
    module not found, import failed, attribute missing, not callable."""
    module_name, attr = _split(spec, field)
    obj = _import(module_name, spec, field)
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = getattr(obj, "__file__", None) or getattr(obj, "__name__", repr(obj))
            names = [n for n in dir(obj) if not n.startswith("_")]
            match = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise ConfigError(f"{field}: {spec!r}: {'.'.join([module_name] + attr.split('.')[:i])}"
                              f" ({where}) has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{field}: {spec!r} is a {type(obj).__name__}, not callable; name a "
                          f"class or a function")
    return obj


def signature_of(fn: Callable) -> tuple[list[inspect.Parameter], bool]:
    """``fn``'s keyword-capable parameters (``self`` excluded for a class) and whether it takes
    ``**kwargs`` (then any keyword is accepted). A callable without a signature takes anything."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], True
    named = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                             inspect.Parameter.KEYWORD_ONLY)]
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


_NUMBERS = {int, float, "int", "float"}


def takes_number(p: inspect.Parameter) -> bool:
    """Whether parameter ``p`` takes a number: its default is an int or float (not a bool), or
    its annotation is ``int``/``float`` (``int | None``, ``Optional[float]`` too; a string
    annotation of ``from __future__ import annotations`` is read as written)."""
    d, a = p.default, p.annotation
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        return True
    if isinstance(a, str):
        a = a.strip("'\"").replace("Optional[", "").rstrip("]")
        parts = {t.strip() for t in a.split("|")}
    else:
        parts = set(typing.get_args(a)) or {a}
    parts -= {"None", type(None)}
    return bool(parts) and parts <= _NUMBERS


def check_no_bool_numbers(params: Iterable[inspect.Parameter], given: Mapping[str, Any], *,
                          what: str, section: str) -> None:
    """ConfigError naming ``<section>.<key>`` for a ``given`` value that is a boolean where the
    parameter of that name :func:`takes_number`: YAML's ``yes``/``true`` is Python's ``True``,
    which is the int 1 (``hidden_size: yes`` would build a model of hidden size 1)."""
    for p in params:
        value = given.get(p.name)
        if isinstance(value, bool) and takes_number(p):
            default = p.default if p.default is not inspect.Parameter.empty else None
            example = f"e.g. `{p.name}: {default}` (its default)" if default is not None \
                else f"e.g. `{p.name}: 1`"
            raise ConfigError(f"{section}.{p.name}: {str(value).lower()} is a boolean (YAML's "
                              f"true/false/yes/no/on/off), but {what} takes a number here; "
                              f"write the number, {example}")


def check_kwargs(fn: Callable, given: Mapping[str, Any], *, what: str, section: str,
                 provided: Iterable[str] = ()) -> None:
    """Each key of ``given`` (argument name -> the recipe's value) must be a keyword argument
    of ``fn``, and no value a boolean where ``fn`` takes a number
    (:func:`check_no_bool_numbers`); each argument of ``fn`` without a default must be given or
    ``provided`` (set by hpclb itself). ``what`` names ``fn`` in messages, ``section`` the
    recipe section (``model``/``data``). Raises ConfigError."""
    params, var_kw = signature_of(fn)
    names = [p.name for p in params]
    provided = set(provided)
    check_no_bool_numbers(params, given, what=what, section=section)
    given = list(given)
    if not var_kw:
        for key in given:
            if key not in names:
                match = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {match[0]!r}?)" if match else ""
                raise ConfigError(f"{section}.{key}: not an argument of {what}{hint}; it takes "
                                  f"{', '.join(n for n in names if n not in provided) or 'none'}")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty
               and p.name not in given and p.name not in provided]
    if missing:
        raise ConfigError(f"{section}.{missing[0]}: required by {what} (no default); add "
                          f"`{missing[0]}: <value>` to the recipe's {section} section")


#: where installed code lives (the interpreter's, the virtualenv's, hpclb's own): never a plug-in
_INSTALLED = tuple(dict.fromkeys(str(Path(d).resolve()) for d in (
    sys.prefix, sys.base_prefix, sys.exec_prefix, Path(__file__).parent)))


def _user_file(file: str | None) -> Path | None:
    """The source file ``file`` of a module, None where there is none (``<stdin>``) or it is
    installed code."""
    if not file:
        return None
    path = Path(file).resolve()
    installed = any(path.is_relative_to(d) for d in _INSTALLED)
    return None if installed or not path.is_file() else path


def source_digests(modules: Iterable[str], dirs: Iterable[str | os.PathLike] = ()
                   ) -> dict[str, str]:
    """Module name -> the SHA-256 of its source file, for the (imported) ``modules`` and every
    module in ``sys.modules`` whose file lies under one of ``dirs`` (a recipe's
    ``plugin_path``: what its plug-ins import from there), sorted by name; installed code (under
    the interpreter's prefixes, hpclb itself) and modules without a file are left out. Raises
    OSError where a file cannot be read."""
    roots = tuple({os.path.join(p, "") for d in dirs
                   for p in (str(Path(d).resolve()), os.path.abspath(d))})
    files = {name: _file_of(sys.modules.get(name)) for name in modules}
    for name, module in list(sys.modules.items()):
        file = _file_of(module)
        if name not in files and file and roots and os.path.abspath(file).startswith(roots):
            files[name] = file
    paths = {name: _user_file(file) for name, file in sorted(files.items())}
    return {name: sha256_file(path) for name, path in paths.items() if path is not None}


def _file_of(module: Any) -> str | None:
    file = getattr(module, "__dict__", {}).get("__file__")
    return file if isinstance(file, str) else None


def resolve_ref(ref: Any) -> Any:
    """``ref`` itself, or the object a ``"package.module:attribute"`` string names (imported on
    use, so that a registry can list names without importing torch). Registries hold either."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(dict):
    """Name -> entry of one extension point (data sets, models, optimizers, task kinds).

    A plain dict (``in``, ``sorted()``, iteration in registration order), plus
    :meth:`register`, which refuses to replace an entry silently, and :meth:`load`, which
    resolves a ``"package.module:attribute"`` entry (:func:`resolve_ref`)."""

    def __init__(self, what: str, entries: dict | None = None):
        super().__init__(entries or {})
        self.what = what

    def register(self, name: str, entry: Any = None, *, replace: bool = False):
        """Add ``entry`` under ``name`` (ValueError if taken, unless ``replace``). Without
        ``entry``, a decorator: ``@REGISTRY.register("name")`` registers the decorated object."""
        if entry is None:
            return lambda obj: self.register(name, obj, replace=replace)
        if name in self and not replace:
            raise ValueError(f"{self.what} {name!r} is already registered; pass replace=True")
        self[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (no error when absent), e.g. at the end of a test."""
        self.pop(name, None)

    def load(self, name: str) -> Any:
        """The entry of ``name`` with a ``module:attr`` string resolved; KeyError if unknown."""
        return resolve_ref(self[name])
