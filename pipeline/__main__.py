"""``python -m pipeline`` runs the GRPO pipeline (same as ``python -m pipeline.grpo``)."""

from .run import exit_now, main

exit_now(main())
