"""``python -m pipeline`` runs the GRPO pipeline (same as ``python -m pipeline.grpo``)."""

import sys

from .grpo import main

sys.exit(main())
