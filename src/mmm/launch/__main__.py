"""``python -m mmm.launch``: the ``launch`` command."""

import sys

from mmm.launch.cli import main

sys.exit(main())
