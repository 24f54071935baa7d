"""Where each role runs: a device per role, checked before any process starts.

``--device`` places every role; ``--trainer-device``, ``--generator-device``,
``--scorer-device`` and ``--ref-device`` override it one role at a time. A
role's model, its batches and the weights it installs live on its device;
tensors cross processes on the CPU (ports carry CPU tensors) and weights
through the chosen transport.
"""

from __future__ import annotations

import torch

from actors import available_transports

from ..config import Config

__all__ = ["ROLES", "PlacementError", "check_alias_across_hosts", "check_placement"]

#: The roles that take a device.
ROLES = ("trainer", "generator", "scorer", "ref")


class PlacementError(ValueError):
    """The requested devices or transport cannot run on this machine; the message says why."""


def _check_device(flag: str, spec: str, here: bool = True) -> torch.device:
    """``spec`` as a device; ``here``: one this machine has (under Ray, the host a role lands on checks its own)."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise PlacementError(f"{flag} {spec}: not a device (use cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise PlacementError(f"{flag} {spec}: only cpu and cuda devices are supported")
    if not here:
        return device
    # counted through NVML where torch can: the driver stays unloaded here, so the roles can be forked from this process
    count = torch.cuda.device_count()
    if count == 0:
        raise PlacementError(f"{flag} {spec} needs CUDA, but this machine has no CUDA device")
    if device.index is not None and device.index >= count:
        raise PlacementError(f"{flag} {spec}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return device


def check_placement(config: Config) -> dict[str, torch.device]:
    """Each role's device, once the placement and the transport can run here; else :class:`PlacementError`.

    Under ``--ray`` the GPUs a placement needs (and ``cuda-ipc``'s) are the hosts' the roles land on, which each
    check their own as the role starts: this machine (a login node without GPUs, say) is not asked for them.
    """
    devices = {}
    here = not config.ray  # under Ray the roles run on the cluster's hosts, which may have GPUs this one lacks
    for role in ROLES:
        flag = f"--{role}-device" if role in config.devices else "--device"
        devices[role] = _check_device(flag, config.device_of(role), here)
    status = available_transports().get(config.transport)
    if status is None:
        raise PlacementError(f"--transport {config.transport}: unknown transport")
    if status != "pass" and (here or config.transport != "cuda-ipc"):
        what = "needs CUDA" if config.transport == "cuda-ipc" else "cannot run here"
        raise PlacementError(f"--transport {config.transport} {what}: {status.removeprefix('blocked: ')}")
    if config.transport == "cuda-ipc" and devices["trainer"].type != "cuda":
        raise PlacementError("--transport cuda-ipc publishes from the trainer's GPU: place the trainer on cuda")
    _check_rank_gpus(config, devices["trainer"])
    if config.install not in ("copy", "alias"):
        raise PlacementError(f"--weights-install {config.install}: choose copy or alias")
    if config.install == "alias":
        source = devices["trainer"] if config.transport == "cuda-ipc" else torch.device("cpu")
        if _same(devices["generator"]) != _same(source):
            raise PlacementError(
                "--weights-install alias makes the generators' parameters views of the published weights, "
                f"which live on {source}: place the generators there too, or install by copy"
            )
    return devices


def check_alias_across_hosts(config: Config, hosts: int) -> None:
    """``--weights-install alias`` with GPU generators on ``hosts`` Ray hosts: refused when there are several (the
    generators spread over them all, and one on another host than the trainer's gets ``tcp`` weights, in host
    memory, which its GPU parameters cannot view); one host's generators alias its ``cuda-ipc`` slots."""
    if config.install == "alias" and hosts > 1 and config.device_of("generator").startswith("cuda"):
        raise PlacementError(
            f"--weights-install alias with --ray over {hosts} hosts: a generator on another host than the trainer's "
            "receives the weights over tcp, in host memory, which its GPU parameters cannot view: install by copy"
        )


def _check_rank_gpus(config: Config, trainer: torch.device) -> None:
    """Trainer ranks on GPUs take one each, from the trainer's on: this machine must have them (Ray: each host checks)."""
    if trainer.type != "cuda" or config.trainer_ranks == 1 or config.ray:
        return
    first, count = trainer.index or 0, torch.cuda.device_count()
    last = first + config.trainer_ranks - 1
    if last >= count:
        raise PlacementError(
            f"--trainer-ranks {config.trainer_ranks} on {config.device_of('trainer')}: the ranks take one GPU each, "
            f"cuda:{first}..cuda:{last}, but this machine has {count} CUDA device(s)"
        )


def _same(device: torch.device) -> tuple[str, int]:
    return device.type, device.index or 0
