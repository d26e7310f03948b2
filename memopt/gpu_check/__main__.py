"""``python3 -m memopt.gpu_check``: see the package's docstring."""
import sys

from memopt.gpu_check.cli import main

sys.exit(main())
