"""The task kinds a recipe may name (``task:``), by name. No torch: the classes are
``"module:attribute"`` strings resolved on use (:func:`hpclb.plugins.resolve_ref`).

Which data sets a kind reads is declared by the data sets themselves
(:attr:`hpclb.data.registry.DataSet.tasks`).
"""
from __future__ import annotations

from dataclasses import dataclass

from hpclb.data.registry import DATASETS
from hpclb.plugins import Registry, resolve_ref

__all__ = ["PLUGIN_DATA_TASKS", "TASKS", "TaskKind", "datasets_of", "register_task",
           "task_metrics"]

#: the kinds a plug-in data function (``data.name: package.module:function``) feeds
PLUGIN_DATA_TASKS = ("classification", "supervised")


@dataclass(frozen=True)
class TaskKind:
    """One kind: its :class:`~hpclb.tasks.base.Task` subclass (or ``"module:attribute"``),
    the model arguments the task sets from the data (the recipe must not), what one training
    sample is (for messages), the metrics its epoch rows hold (``metrics``; a recipe's target
    must name one), the data-section keys it reads beyond ``name``/``train_samples``/
    ``test_samples``/the data set's own options (``data_options``), and whether the recipe
    gives its loss and metrics (``task: {name, loss, metrics}``: ``own_loss``)."""

    name: str
    task: type | str
    model_args: tuple[str, ...] = ()
    sample_unit: str = "samples"
    metrics: tuple[str, ...] = ("train_loss", "test_loss")
    data_options: tuple[str, ...] = ()
    own_loss: bool = False

    def task_class(self) -> type:
        return resolve_ref(self.task)


TASKS: Registry = Registry("task kind")


def register_task(kind: TaskKind, *, replace: bool = False) -> TaskKind:
    """Add ``kind`` to :data:`TASKS` (ValueError if its name is taken, unless ``replace``)."""
    return TASKS.register(kind.name, kind, replace=replace)


for _kind in (
    TaskKind("classification", "hpclb.tasks.classification:ClassificationTask",
             metrics=("train_loss", "train_accuracy", "test_loss", "test_accuracy")),
    TaskKind("language_model", "hpclb.tasks.language_model:LanguageModelTask", ("vocab_size",),
             "bptt-token sequences", ("train_loss", "train_perplexity", "valid_loss",
                                      "valid_perplexity", "test_loss", "test_perplexity"),
             ("bptt", "eval_streams")),
    TaskKind("seq2seq", "hpclb.tasks.seq2seq:Seq2seqTask", ("src_vocab", "tgt_vocab"),
             metrics=("train_loss", "train_perplexity", "test_loss", "test_perplexity",
                      "test_bleu"),
             data_options=("source", "target", "vocab_size", "max_length", "eval_samples",
                           "beam_size", "length_penalty")),
    TaskKind("supervised", "hpclb.tasks.supervised:SupervisedTask", own_loss=True),
):
    register_task(_kind)


def task_metrics(kind: str, metrics=()) -> tuple[str, ...]:
    """The metrics the epoch rows of a ``kind`` run hold: the kind's, plus ``test_<name>`` for
    each of a recipe's own ``metrics`` (``task.metrics``)."""
    return TASKS[kind].metrics + tuple(f"test_{m}" for m in metrics)


def datasets_of(kind: str) -> tuple[str, ...]:
    """The registered data sets a ``kind`` task reads, in registration order."""
    return tuple(name for name, ds in DATASETS.items() if kind in ds.tasks)
