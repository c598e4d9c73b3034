"""``python -m mmm.plan``: see :mod:`mmm.plan.cli`."""

from mmm.plan.cli import cli

cli()
