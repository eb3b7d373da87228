"""``python -m hpclb``: the ``hpclb`` command line (:func:`hpclb.cli.main`)."""
import sys

from hpclb.cli import main

sys.exit(main())
