"""Real parameter shapes of two large-batch workloads, as data (nothing is downloaded).

``RESNET50``: torchvision ``resnet50()`` in ``named_parameters()`` order: 161 tensors,
25,557,032 parameters (the LARS ImageNet workload of You, Gitman, Ginsburg 2017).
``BERT_LARGE``: Hugging Face ``BertModel`` for ``bert-large-uncased`` (24 layers, hidden 1024,
intermediate 4096, vocabulary 30,522, 512 positions, 2 token types, with pooler) in
``named_parameters()`` order: 391 tensors, 335,141,888 parameters (the LAMB workload of
You et al., ICLR 2020). Each entry is ``(name, shape)``.

The data lives in ``shapes.json`` beside this module (``{set name: [[name, shape], ...]}``,
shipped as package data); it is read once, at import.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BERT_LARGE", "RESNET50", "SETS"]

_Shapes = list[tuple[str, tuple[int, ...]]]


def _load(path: Path) -> dict[str, _Shapes]:
    raw = json.loads(path.read_text())
    return {k: [(name, tuple(shape)) for name, shape in v] for k, v in raw.items()}


#: parameter sets by name
SETS: dict[str, _Shapes] = _load(Path(__file__).with_name("shapes.json"))
RESNET50: _Shapes = SETS["resnet50"]
BERT_LARGE: _Shapes = SETS["bert_large"]
