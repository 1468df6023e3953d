"""``python -m sglang_sparse.traces`` -> :func:`sglang_sparse.traces.cli.main`."""

import sys

from .cli import main

sys.exit(main())
