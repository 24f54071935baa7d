"""A transformer's repeated blocks, and compiling them one by one with ``torch.compile`` (``--compile``).

A trainer step of a small model on a GPU is bound by its many small
kernels (norms, rotary embeddings, activations, residual adds: the H100
profile of the 0.5 B shape), not by its matrix products; inductor fuses
them. Compiling each block rather than the whole model (PyTorch's
"regional compilation") traces one layer: every block of a class shares
the compiled code, so compiling takes seconds whatever the depth, and the
code is compiled for dynamic shapes, so passes of other rows or lengths
compile nothing new.
"""

from __future__ import annotations

import logging

import torch

from ._causal_lm import ModelError
from ._compiler import require_compiler

__all__ = ["compile_blocks", "repeated_blocks"]

_log = logging.getLogger(__name__)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: those its ``_no_split_modules`` names (a Hugging Face model's layers), else
    the members of its outermost ``ModuleList``\\ s (a ``ModuleList`` inside a block, a mixture's experts, is part
    of that block: sharded apart, an expert a rank's rows did not reach would miss that rank's all-gather)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [module for module in model.modules() if type(module).__name__ in names]
    if isinstance(model, torch.nn.ModuleList):
        return list(model)
    return [block for child in model.children() for block in repeated_blocks(child)]


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each of ``model``'s repeated blocks in place (its parameters and their names unchanged); how many.

    The first call of a block compiles it (the first step waits for the
    compiler); the numbers are the eager block's up to rounding. A host
    without the compiler inductor needs is refused now, in one line.
    """
    blocks = repeated_blocks(model)
    if not blocks:
        raise ModelError(
            f"--compile: {type(model).__name__} has no repeated blocks to compile (no _no_split_modules, no ModuleList)"
        )
    require_compiler(next(model.parameters()).device, "--compile")
    for block in blocks:
        block.compile(dynamic=True)
    kinds = ", ".join(sorted({type(block).__name__ for block in blocks}))
    _log.info("%s: %d blocks (%s) compiled by torch.compile", type(model).__name__, len(blocks), kinds)
    return len(blocks)
