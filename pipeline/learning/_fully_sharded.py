"""Fully sharded data parallelism (FSDP2): each trainer rank holds a shard of the weights, gradients and Adam state.

``--trainer-shard fsdp`` shards the policy with torch's ``fully_shard``: one
unit per repeated block (a Hugging Face model's ``_no_split_modules``, else
the members of its ``ModuleList``\\ s) and the module the loss runs the
policy through as the root (:meth:`Task.forward_module`), so every
parameter is gathered by the forward that uses it. A rank then holds its
shard of every tensor plus, while one runs, one block gathered whole.

Because every forward gathers and every backward reduce-scatters, the ranks
must run the same number of passes: a rank with fewer micro-batches runs
*idle* passes (one of its own rows, its loss counted zero) until it has as
many as the busiest (:meth:`FullySharded.idle_passes`). Gradients are
summed, not averaged, across ranks (each rank's loss is already its share
of the rollout's), by a sum-only reduce-scatter gloo also runs; a
parameter a rank's rows did not reach (a mixture's expert) counts zero
there, so ranks whose rows took different experts still line up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..models import repeated_blocks
from ._data_parallel import DataParallel, RankShare

__all__ = ["FullySharded", "group_kind"]


class FullySharded(DataParallel):
    """A rank of a group that shards the policy (FSDP2) rather than replicating it: see the module's docstring."""

    _root: torch.nn.Module | None = None  # set once, by shard()

    def shard(self, policy: torch.nn.Module, root: torch.nn.Module, compute: torch.dtype = torch.float32) -> None:
        """Shard ``policy`` in place: a unit per repeated block, ``root`` (the module the loss calls) over them.

        With a ``compute`` dtype below float32, FSDP2 gathers the weights in it
        and computes in it, reducing gradients in float32 into float32 shards
        (its ``MixedPrecisionPolicy``, in place of autocast: under autocast the
        weights' gradients reach their shards through a cast after FSDP's own
        hook has run, and part of them was lost: measured, 1.74 against 2.34).
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (  # ~0.6 s to import: only where ranks shard
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )

        # float32: FSDP2's default policy (no casts); else gathered and computed in ``compute``
        mixed = (
            MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
            if compute != torch.float32
            else MixedPrecisionPolicy()
        )

        if self._root is not None:
            raise RuntimeError("this rank's policy is already sharded")
        if root is not policy and not any(module is policy for module in root.modules()):
            raise ValueError(f"the forward module ({type(root).__name__}) must hold the policy it runs")
        # the mesh named from this rank's device: FSDP's own default is CUDA wherever CUDA exists,
        # which would move a CPU trainer's shards to a GPU
        mesh = init_device_mesh(self.device.type, (self.share.world,))
        for block in repeated_blocks(policy):
            fully_shard(block, mesh=mesh, mp_policy=mixed)
        fully_shard(root, mesh=mesh, mp_policy=mixed)
        for module in root.modules():
            if isinstance(module, FSDPModule):  # each rank's loss is its share already: sum, never average
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
                # a parameter this rank's rows did not reach (an expert no row was routed to) counts zero in the
                # sum: reduce-scattered without it, the ranks' collectives would not line up (torch 2.8+)
                unused = getattr(module, "set_reduce_scatter_unused_params", None)
                if unused is not None:
                    unused(True, recurse=False)
        self._root = root

    def idle_passes(self, slices: list[slice], rows: int | None, within: slice | None = None) -> list[slice]:
        """Passes of one of this rank's rows, counted zero, so that it runs as many passes as the busiest rank."""
        share = self.share
        counts = [len(RankShare(rank, share.world).passes(slices, rows, within)) for rank in range(share.world)]
        start, _ = share.block(rows or 0, within)
        return [slice(start, start + 1)] * (max(counts) - counts[share.rank])

    def sum_gradients(self, module: torch.nn.Module) -> None:
        """Nothing left to do: each backward's reduce-scatter summed this rank's shard of the gradients."""
        return

    @contextlib.contextmanager
    def whole_root(self) -> Iterator[None]:
        """The root's own parameters gathered, for code that calls the policy's modules without the root's forward.

        Generation calls the model's forward, not the loss's root module: the
        blocks gather themselves, the root's parameters (embeddings, final
        norm, head) are gathered here. A collective: every rank enters it.
        """
        from torch.distributed.fsdp import FSDPModule

        root = self._root
        if not isinstance(root, FSDPModule):
            yield
            return
        root.unshard()
        try:
            yield
        finally:
            root.reshard()


def group_kind(shard: str) -> type[DataParallel]:
    """The rank class ``--trainer-shard`` names: ``ddp`` replicates the policy, ``fsdp`` shards it."""
    kinds: dict[str, type[DataParallel]] = {"ddp": DataParallel, "fsdp": FullySharded}
    if shard not in kinds:
        raise ValueError(f"--trainer-shard {shard!r}: choose ddp or fsdp")
    return kinds[shard]
