"""The task kinds a recipe may name (``task:``), by name. No torch: the classes are
``"module:attribute"`` strings resolved on use (:func:`hpclb.plugins.resolve_ref`).

Which data sets a kind reads is declared by the data sets themselves
(:attr:`hpclb.data.registry.DataSet.tasks`).
"""
from __future__ import annotations

from dataclasses import dataclass

from hpclb.data.registry import DATASETS
from hpclb.plugins import Registry, resolve_ref

__all__ = ["TASKS", "TaskKind", "datasets_of", "register_task"]


@dataclass(frozen=True)
class TaskKind:
    """One kind: its :class:`~hpclb.tasks.base.Task` subclass (or ``"module:attribute"``),
    the model arguments the task sets from the data (the recipe must not), and what one
    training sample is (for messages)."""

    name: str
    task: type | str
    model_args: tuple[str, ...] = ()
    sample_unit: str = "samples"

    def task_class(self) -> type:
        return resolve_ref(self.task)


TASKS: Registry = Registry("task kind")


def register_task(kind: TaskKind, *, replace: bool = False) -> TaskKind:
    """Add ``kind`` to :data:`TASKS` (ValueError if its name is taken, unless ``replace``)."""
    return TASKS.register(kind.name, kind, replace=replace)


for _kind in (
    TaskKind("classification", "hpclb.tasks.classification:ClassificationTask"),
    TaskKind("language_model", "hpclb.tasks.language_model:LanguageModelTask", ("vocab_size",),
             "bptt-token sequences"),
    TaskKind("seq2seq", "hpclb.tasks.seq2seq:Seq2seqTask", ("src_vocab", "tgt_vocab")),
):
    register_task(_kind)


def datasets_of(kind: str) -> tuple[str, ...]:
    """The registered data sets a ``kind`` task reads, in registration order."""
    return tuple(name for name, ds in DATASETS.items() if kind in ds.tasks)
