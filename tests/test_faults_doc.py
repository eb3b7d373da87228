"""docs/faults.md states the thresholds the code uses: every number in its rules table that is a
threshold (a factor ``N×``, a ``default N``, ``under N KiB``, ``≥ N``, ``<= N``) is found and
checked against the constant in the code, and none is left unchecked."""
import re
from pathlib import Path

from hpclb.config.settings import RunConfig
from hpclb.sync.optimizer import CALIBRATION_SCALE
from hpclb.sync.options import SMALL_FUSION_BYTES, TRAIN_STALL_ABORT_S
from hpclb.train.loop import EXPLODED_LOSS_FACTOR

DOC = Path(__file__).resolve().parents[1] / "docs" / "faults.md"
THRESHOLD = re.compile(r"(\d+(?:\.\d+)?)×|default (\d+)|under (\d+) KiB|[≥≤] (\d+)|<= (\d+)")


def _rules_table() -> str:
    text = DOC.read_text()
    return text[text.index("## The rules"):text.index("## The fault matrix")]


def test_every_threshold_in_faults_md_is_the_codes():
    table = _rules_table()
    expected = {
        r"over (\d+)× the first applied step's": EXPLODED_LOSS_FACTOR,
        r"`max_nonfinite_steps` \(default (\d+)\)": RunConfig.max_nonfinite_steps,
        r"loss scale is ≥ (\d+)": CALIBRATION_SCALE,
        r"`--keep-checkpoints`, default (\d+)": RunConfig.keep_checkpoints,
        r"`fusion_threshold_bytes` under (\d+) KiB": SMALL_FUSION_BYTES / 1024,
        r"`eps <= (\d+)`": 0,
        r"default (\d+) s in `hpclb train`": TRAIN_STALL_ABORT_S,
    }
    checked = set()
    for pattern, value in expected.items():
        m = re.search(pattern, table)
        assert m, f"docs/faults.md no longer says {pattern!r}"
        assert float(m.group(1)) == value, (pattern, m.group(1), value)
        checked.add(m.start(1))
    found = {next(m.start(g) for g in range(1, 6) if m.group(g)) for m in THRESHOLD.finditer(table)}
    assert found == checked, [table[i:i + 30] for i in sorted(found - checked)]
