"""``python -m memopt.report``: see the package docstring."""
import sys

from memopt.report import main

sys.exit(main())
