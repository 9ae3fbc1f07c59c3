"""`python -m minillm.bench <name> [options]`: see minillm.bench.cli.dispatch."""
import sys

from minillm.bench.cli import dispatch

sys.exit(dispatch())
