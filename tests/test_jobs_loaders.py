"""The training-set sizes hpclb.tools.jobs renders from (a table, for login nodes without the data)
agree with the loaders where the data is staged (slow: the loaders read and tokenise it)."""
import os
from pathlib import Path

import pytest

from hpclb.config import load_recipe
from hpclb.tools import jobs

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = jobs.example_specs()


@pytest.mark.parametrize("exp", sorted({s.experiment for _, s in EXAMPLES}))
def test_train_set_size_table_agrees_with_the_loader(exp):
    """Where the data is staged, the table's N is the N `hpclb train` will schedule with."""
    from hpclb.tasks import build_task

    recipe = load_recipe(exp)
    root = Path(os.environ.get("HPCLB_DATA", REPO / "data"))
    if not (root / recipe["data"]["name"]).is_dir():
        pytest.skip(f"{recipe['data']['name']} not staged in {root}")
    assert build_task(recipe, str(root)).num_train_samples == jobs.train_set_size(recipe)[0]
