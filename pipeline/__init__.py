"""The asynchronous GRPO pipeline built on ``actors`` (issue 4; not yet written)."""
