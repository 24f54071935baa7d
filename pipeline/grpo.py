"""``python -m pipeline.grpo``: train with GRPO from the command line (``--help`` lists the flags).

The launcher itself lives in :mod:`pipeline.run`; this module is the
command's name, and keeps ``from pipeline.grpo import main, parse_args``
working.
"""

from .run import PipelineError, Roles, RunResult, exit_now, main, parse_args, run_pipeline

__all__ = ["PipelineError", "Roles", "RunResult", "exit_now", "main", "parse_args", "run_pipeline"]

if __name__ == "__main__":
    exit_now(main())
