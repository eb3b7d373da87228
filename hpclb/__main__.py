import sys

from hpclb.cli import main

sys.exit(main())
