"""``python -m hpclb``: the ``hpclb`` command line (:func:`hpclb.cli.run`)."""
from hpclb.cli import run

run()
