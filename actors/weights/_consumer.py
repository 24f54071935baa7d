"""The rollout side of weight sync: import, install, acknowledge or reject, release."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterable

import torch

from .._shared._errors import (
    ChecksumError,
    LifecycleError,
    ManifestError,
    PublisherDied,
    TransportBlocked,
    WeightSyncError,
)
from .._shared._liveness import pid_exists
from .._shared._loops import loop_running
from .._shared._readiness import fd_ready
from .._shared._session import host_id
from ..tensors import Reader, TensorSpec, checksum, copy_all, dtype_name, is_sharded, read_async, release_async
from ._manifest import WeightManifest, make_reader
from ._off_the_loop import OFFLOAD_BYTES, on_a_gpu, to_thread_after_queued_work, to_thread_to_the_end
from ._spec_table import SpecMemo

__all__ = ["PublisherWatch", "WeightConsumer", "fit"]

log = logging.getLogger("actors.weights")

_IMPORTED, _ACKNOWLEDGED, _REJECTED, _RELEASED = "imported", "acknowledged", "rejected", "released"


class PublisherWatch:
    """Whether the processes that published updates are alive, through Linux pidfds.

    A pidfd turns readable the moment its process exits, so a death is seen
    without polling or heartbeats, and an event loop can wait for it. Where
    ``pidfd_open`` is refused (a sandbox's seccomp profile), a pid is only
    asked whether it exists, and its death is not awaited.
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self.dead: set[int] = set()
        self._unwatchable: set[int] = set()  # pids pidfd_open was refused for
        self._waits: dict[int, _DeathWait] = {}  # pids whose death an event loop awaits (their fd stays open)

    def alive(self, pid: int) -> bool:
        if pid == os.getpid():
            return True
        fd = self._fd(pid)
        if pid in self._unwatchable:
            return pid_exists(pid)
        if fd is None:
            return False
        if fd_ready(fd):
            self._died(pid)
            return False
        return True

    def _fd(self, pid: int) -> int | None:
        if pid in self.dead:
            return None
        fd = self._fds.get(pid)
        if fd is None:
            if pid in self._unwatchable:
                return None
            try:
                fd = self._fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                self.dead.add(pid)
                return None
            except OSError:  # refused here, not a dead process
                self._unwatchable.add(pid)
                return None
        return fd

    def _died(self, pid: int) -> None:
        """``pid`` exited: its fd is closed, unless a wait still has it registered (the last waiter closes it)."""
        self.dead.add(pid)
        if pid in self._waits:
            return
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    async def death(self, pid: int) -> None:
        """Return once ``pid`` has exited (at once if it already has); any number of tasks may wait for one pid."""
        if pid == os.getpid():
            await asyncio.get_running_loop().create_future()  # never: this process is alive while it waits
        wait = self._waits.get(pid)
        if wait is None:
            fd = self._fd(pid)
            if pid in self._unwatchable:
                await asyncio.get_running_loop().create_future()  # never: its death cannot be seen (callers time out)
            if fd is None:
                return
            wait = self._waits[pid] = _DeathWait(fd, asyncio.get_running_loop())
        wait.waiters += 1
        try:
            await asyncio.shield(wait.exited)
        finally:
            wait.waiters -= 1
            if wait.waiters == 0 and self._waits.get(pid) is wait:  # (else close() ended it)
                wait.loop.remove_reader(wait.fd)
                del self._waits[pid]
                if wait.exited.done() or pid in self.dead:  # (a check meanwhile saw it exit: its fd is closed now)
                    self._died(pid)

    def close(self) -> None:
        """Close every pidfd; a wait still registered is ended (its waiters' ``death`` raises CancelledError)."""
        for wait in self._waits.values():
            with contextlib.suppress(Exception):  # (its loop closed already)
                wait.loop.remove_reader(wait.fd)
            wait.exited.cancel()
        self._waits.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _DeathWait:
    """One pid's exit, awaited on an event loop by ``waiters`` tasks through its pidfd."""

    __slots__ = ("exited", "fd", "loop", "waiters")

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fd = fd
        self.loop = loop
        self.exited: asyncio.Future[None] = loop.create_future()
        self.waiters = 0
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


def _close_all(readers: list[Reader]) -> None:
    """Close each reader (a ``cuda-ipc`` one still holding an update waits for the GPU's reads of it)."""
    for reader in readers:
        reader.close()


def _check_type(manifest: object) -> None:
    """A WeightManifest whose own fields are sound (TypeError, or ManifestError naming the bad fields)."""
    if not isinstance(manifest, WeightManifest):
        raise TypeError(f"expected a WeightManifest, got {type(manifest).__name__}")
    manifest.checked()


def _alias(
    model: torch.nn.Module, targets: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], strict: bool
) -> None:
    """Make the module's tensors named in ``targets`` views of the update's ``tensors``.

    Each parameter or buffer keeps its identity and takes the update's
    storage (``.data``): 0.11 ms for 289 tensors, where
    ``load_state_dict(assign=True)`` built a new ``Parameter`` for each
    through the module tree (1.9 ms, measured in one process). A module whose state_dict names are not its tensors' own
    (one that renames them in hooks), or sharded ones, take the
    ``load_state_dict`` path.
    """
    own: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    if all(name in own and not is_sharded(own[name]) for name in targets):
        for name in targets:
            own[name].data = tensors[name]
    else:
        model.load_state_dict(tensors, strict=strict, assign=True)


def _copies(views: Iterable[tuple[str, torch.Tensor, torch.device]]) -> dict[str, torch.Tensor]:
    """A copy of each named view on the device given with it; names that view the same bytes (a tied head) share one."""
    made: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.device], torch.Tensor] = {}
    copies: dict[str, torch.Tensor] = {}
    for name, tensor, device in views:
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), device)
        if key not in made:
            made[key] = tensor.to(device=device, copy=True)
        copies[name] = made[key]
    return copies


def fit(
    manifest: WeightManifest, specs: tuple[TensorSpec, ...], model: torch.nn.Module, strict: bool = True
) -> dict[str, torch.Tensor]:
    """The model's tensors that ``manifest`` (its ``specs``) updates, once every name, shape and dtype agrees.

    Checked before anything is imported or written: a manifest that does not
    fit raises :class:`ManifestError` and the model stays as it was.
    """
    state = model.state_dict()
    named: dict[str, TensorSpec] = {}
    for spec in specs:
        if type(spec.name) is not str:
            raise ManifestError(f"update {manifest.update_id} holds a malformed tensor spec")
        named[spec.name] = spec
    if strict:
        missing, unexpected = sorted(state.keys() - named.keys()), sorted(named.keys() - state.keys())
        if missing or unexpected:
            raise ManifestError(
                f"update {manifest.update_id} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
    targets = {}
    for name, spec in named.items():
        target = state.get(name)
        if target is None:
            continue
        shape = tuple(target.shape)
        if spec.dtype != dtype_name(target.dtype) or spec.shape != shape:
            raise ManifestError(
                f"update {manifest.update_id}: tensor {name!r} is {spec.dtype}{list(spec.shape)}, "
                f"the model's is {dtype_name(target.dtype)}{list(shape)}"
            )
        targets[name] = target
    return targets


class WeightConsumer:
    """Rollout side: imports, installs, acknowledges or rejects, and releases updates.

    ``verify_checksums`` checks every tensor that carries a checksum at import.
    An update whose publisher has exited is refused with :class:`PublisherDied`
    (seen through its pid on this host, or its refused connection for ``tcp``
    from another host); the model keeps the weights it last installed.
    """

    def __init__(self, *, verify_checksums: bool = True, history: int = 4096) -> None:
        self.verify_checksums = verify_checksums
        self._readers: dict[str, Reader] = {}
        self._state: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._reasons: dict[str, str] = {}
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._memo = SpecMemo()
        self._history = history
        #: The updates modules' parameters view (aliasing installs), each with the modules that view it: held
        #: until the last of them installs another (or is gone).
        self._viewers: dict[str, weakref.WeakSet[torch.nn.Module]] = {}
        #: Releases begun and cut short (cancelled, a GPU that did not finish its reads in time), by update, with
        #: the transport asked for: made first by the next release, so no slot stays held for good.
        self._owed: dict[str, str | None] = {}
        self.publishers = PublisherWatch()
        #: This process's :func:`~actors.host_id`: only publishers on it are watched by pid.
        self.host = host_id()
        self.installed_version: int | None = None
        #: Pid of the publisher of the last update installed.
        self.installed_from: int | None = None

    def state(self, update_id: str) -> str | None:
        """``imported``, ``acknowledged``, ``rejected``, ``released`` or None if unknown."""
        return self._state.get(update_id)

    def specs(self, manifest: WeightManifest) -> tuple[TensorSpec, ...]:
        """``manifest``'s tensor specs, rebuilt only when its table differs from the last one's (:class:`SpecMemo`)."""
        return self._memo.specs(manifest.checked_table())

    def reader(self, transport: str) -> Reader:
        reader = self._readers.get(transport)
        if reader is None:
            reader = self._readers[transport] = make_reader(transport)
        return reader

    def import_update(self, manifest: WeightManifest) -> dict[str, torch.Tensor]:
        """The update's tensors, valid until :meth:`release` (views, for ``shm`` and ``cuda-ipc``).

        A ``tcp`` update is fetched here, which blocks: on an event loop use
        :meth:`import_update_async`.
        """
        self.check_blocking_allowed(manifest)
        held = self._start_import(manifest)
        if held is not None:
            return held
        reader = self.reader(manifest.transport)
        try:
            tensors = reader.read(manifest.update_id, manifest.version, manifest.handle, self.specs(manifest))
        except PublisherDied as exc:
            raise self._publisher_died(manifest, exc) from None
        try:
            self._verify(manifest, tensors)
        except BaseException:  # (a mismatch, a Ctrl-C or a device error while the bytes were checked)
            reader.release(manifest.update_id)
            raise
        return self._imported(manifest, tensors)

    async def import_update_async(
        self, manifest: WeightManifest, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """:meth:`import_update` for code on an event loop: a ``tcp`` fetch runs off the loop's thread.

        ``timeout`` bounds the fetch (default: the reader's, 120 s for ``tcp``).
        """
        held = self._start_import(manifest)
        if held is not None:
            return held
        reader = self.reader(manifest.transport)
        try:
            tensors = await read_async(
                reader, manifest.update_id, manifest.version, manifest.handle, self.specs(manifest), timeout
            )
        except PublisherDied as exc:
            raise self._publisher_died(manifest, exc) from None
        try:
            await self._verify_async(manifest, tensors)
        except BaseException:  # (a mismatch, or the caller cancelled while the bytes were checked)
            await release_async(reader, manifest.update_id)  # (a cuda-ipc release's wait for the GPU is awaited)
            raise
        return self._imported(manifest, tensors)

    def check_blocking_allowed(self, manifest: WeightManifest) -> None:
        """Refuse, before anything of the update is held or decided, a blocking import that would fetch bytes
        over the network on a running event loop's thread (``tcp``): the update stays importable the async way.
        One already imported is fetched no more: its install into another module goes on."""
        _check_type(manifest)
        if manifest.update_id in self._tensors or not loop_running():
            return
        try:
            reader = self.reader(manifest.transport)
        except Exception:  # (an unknown transport, or one unusable here: its own import refuses it, once taken)
            return
        if hasattr(reader, "read_async"):
            raise WeightSyncError(
                f"a {manifest.transport!r} update is fetched over the network, and a blocking install or import "
                "would block this running event loop: use `await install_async(...)` (`import_update_async`, "
                "`install_newest_async`), which fetch off the loop"
            )

    def _start_import(self, manifest: WeightManifest) -> dict[str, torch.Tensor] | None:
        """The tensors if ``manifest`` is already imported; refuses released, rejected and orphaned updates."""
        _check_type(manifest)
        update_id = manifest.update_id
        state = self._state.get(update_id)
        if state in (_RELEASED, _REJECTED):
            raise LifecycleError(f"update {update_id} was already {state}; it cannot be imported")
        if update_id in self._owed:  # (its tensors are forgotten, its storage half let go)
            raise LifecycleError(
                f"update {update_id} is being released (a release cut short is owed); it cannot be imported"
            )
        if state is not None:
            return dict(self._tensors[update_id])
        if self.on_this_host(manifest) and not self.publishers.alive(manifest.publisher_pid):
            raise self._publisher_died(manifest, None)
        return None

    def on_this_host(self, manifest: WeightManifest) -> bool:
        """Whether ``manifest``'s publisher shares this host (so its pid can be watched here)."""
        return manifest.publisher_host in ("", self.host)

    def _publisher_died(self, manifest: WeightManifest, cause: PublisherDied | None) -> PublisherDied:
        self.reject(manifest.update_id, "its publisher exited")
        how = f" ({cause})" if cause is not None else ""
        return PublisherDied(
            f"update {manifest.update_id} (version {manifest.version}): its publisher (pid {manifest.publisher_pid}) "
            f"has exited{how}; the installed weights (version {self.installed_version}) stay",
            pid=manifest.publisher_pid,
        )

    def _verify(self, manifest: WeightManifest, tensors: dict[str, torch.Tensor]) -> None:
        """Raise :class:`ChecksumError` for a tensor whose bytes are not those its publisher summed (if checked)."""
        if self.verify_checksums:
            for spec in self.specs(manifest):
                if spec.checksum is not None and checksum(tensors[spec.name]) != spec.checksum:
                    raise ChecksumError(
                        f"tensor {spec.name!r} of update {manifest.update_id} does not match its checksum"
                    )

    async def _verify_async(self, manifest: WeightManifest, tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`_verify` for an event loop: a pass over 1 MiB or more, or over GPU memory (read back to the host,
        waiting for the GPU), runs on a worker thread, after the reads this thread queued on its streams."""
        if not self.verify_checksums or all(spec.checksum is None for spec in self.specs(manifest)):
            return
        named = list(tensors.items())
        if manifest.total_nbytes < OFFLOAD_BYTES and not on_a_gpu(named):
            self._verify(manifest, tensors)
        else:  # (after the reads, ordered on this thread's streams)
            await to_thread_after_queued_work(named, self._verify, manifest, tensors)

    def _imported(self, manifest: WeightManifest, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        update_id = manifest.update_id
        self._set(update_id, _IMPORTED)
        self._tensors[update_id] = tensors
        return dict(tensors)

    def install(
        self, manifest: WeightManifest, model: torch.nn.Module, *, strict: bool = True, alias: bool = False
    ) -> None:
        """Check the update fits, import, load into ``model`` and acknowledge; reject on any failure.

        By default the tensors are copied into the module (one copy; device
        to device for ``cuda-ipc``) and the caller releases the update
        afterwards. With ``alias=True`` nothing is copied: the module's
        parameters become views of the update's storage (read-only shared
        memory for ``shm``, the publisher's device slot for ``cuda-ipc``), so
        the module must only be read, and must be on the update's device. The
        update then stays held until the next install replaces it (do not
        release it yourself); publishers need one more slot than aliasing
        consumers. A failed install leaves the module as it was.
        """
        self.check_blocking_allowed(manifest)
        try:
            targets = fit(manifest, self.specs(manifest), model, strict)
            tensors = self.import_update(manifest)
            self._load(manifest, model, targets, tensors, strict, alias)
        except BaseException as exc:
            self._failed(manifest, exc)
            raise
        for replaced in self._owing(self._installed(manifest, model, alias)):
            self.release(replaced)

    async def install_async(
        self,
        manifest: WeightManifest,
        model: torch.nn.Module,
        *,
        strict: bool = True,
        alias: bool = False,
        timeout: float | None = None,
    ) -> None:
        """:meth:`install` for code on an event loop: a ``tcp`` fetch is awaited, not blocked on."""
        _check_type(manifest)
        try:
            targets = fit(manifest, self.specs(manifest), model, strict)
            tensors = await self.import_update_async(manifest, timeout)
            self._load(manifest, model, targets, tensors, strict, alias)
        except BaseException as exc:
            self._failed(manifest, exc)
            raise
        for replaced in self._owing(self._installed(manifest, model, alias)):
            await self.release_async(replaced)

    async def load_async(
        self,
        manifest: WeightManifest,
        loader: Callable[[dict[str, torch.Tensor]], None],
        *,
        timeout: float | None = None,
    ) -> None:
        """Import the update, hand its tensors to ``loader``, and acknowledge; reject on any failure.

        For a destination that is not a module with the publisher's names (an
        inference engine whose layers fuse or rename them): ``loader`` copies
        what it needs out of the tensors, which are views valid only during
        the call. The caller releases the update afterwards. A loader that
        raises leaves the update rejected with its message. A module that
        views an earlier update (an aliasing install) still does: that
        update stays held.
        """
        _check_type(manifest)
        try:
            tensors = await self.import_update_async(manifest, timeout)
            loader(tensors)
        except BaseException as exc:
            self._failed(manifest, exc)
            raise
        self._acknowledged(manifest)  # (a module that views an aliased update still does: it stays held)

    def _load(
        self,
        manifest: WeightManifest,
        model: torch.nn.Module,
        targets: dict[str, torch.Tensor],
        tensors: dict[str, torch.Tensor],
        strict: bool,
        alias: bool,
    ) -> None:
        with torch.no_grad():
            left = self._views_left(manifest, model, targets)
            if alias:
                for name, target in targets.items():
                    if tensors[name].device != target.device:
                        raise WeightSyncError(
                            f"an aliasing install needs the update on the model's device: {name!r} is on "
                            f"{tensors[name].device}, the model on {target.device} (install with alias=False)"
                        )
                _alias(model, targets, tensors, strict)
            else:
                fresh = self._storage_of_their_own(targets, tensors)
                seen: set[tuple[int, int, tuple[int, ...]]] = set()
                names = []
                for name, target in targets.items():  # a tied head is its embedding's bytes on both sides: copied once
                    pair = (target.data_ptr(), tensors[name].data_ptr(), tuple(target.shape))
                    if name not in fresh and pair not in seen:
                        seen.add(pair)
                        names.append(name)
                copy_all([targets[n] for n in names], [tensors[n] for n in names])
                if fresh:
                    _alias(model, fresh, fresh, strict=False)
            if left:
                _alias(model, left, left, strict=False)

    def _storage_of_their_own(
        self, targets: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """For each target that views an aliased update's slot, a copy of the new update's tensor to take instead.

        Copying into such a target would write into that update's slot:
        read-only shared memory for ``shm`` (a crash), the publisher's device
        slot for ``cuda-ipc``. Tied targets share one copy. Made before
        anything is written, and taken after the rest is copied, so a failed
        install leaves the module as it was.
        """
        slot_storage = self._aliased_storage()
        return _copies(
            (name, tensors[name], target.device)
            for name, target in targets.items()
            if target.untyped_storage().data_ptr() in slot_storage
        )

    def _views_left(
        self, manifest: WeightManifest, model: torch.nn.Module, targets: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Copies of the module's tensors that view the aliased update this install replaces but that it does not
        update (``strict=False``): taken after the install, so releasing that update frees nothing they read.

        Tied tensors share one copy. Made before anything is written (the
        replaced update's slot is never written by an install).
        """
        viewed = self._viewed_by(model)
        if viewed is None or viewed == manifest.update_id:
            return {}
        slot_storage = self._storage_of(viewed)
        return _copies(
            (name, tensor, tensor.device)
            for name, tensor in model.state_dict().items()
            if name not in targets and tensor.untyped_storage().data_ptr() in slot_storage
        )

    def _aliased_storage(self) -> set[int]:
        """The storages of every update a module views (empty if none)."""
        return {pointer for update_id in self._viewers for pointer in self._storage_of(update_id)}

    def _storage_of(self, update_id: str) -> set[int]:
        viewed = self._tensors.get(update_id)
        return {tensor.untyped_storage().data_ptr() for tensor in viewed.values()} if viewed else set()

    def _viewed_by(self, model: torch.nn.Module) -> str | None:
        """The update ``model``'s parameters view (None if it owns its storage)."""
        return next((update_id for update_id, modules in self._viewers.items() if model in modules), None)

    def _failed(self, manifest: WeightManifest, exc: BaseException) -> None:
        """Reject the update after a failed install, unless only this manifest was refused.

        A manifest that is malformed, does not fit the model or names a device
        this process cannot see is refused before anything of the update is
        held: the update itself stays unknown here, so a good manifest of it
        still installs.
        """
        state = self._state.get(manifest.update_id)
        if state is None and isinstance(exc, (ManifestError, TransportBlocked)):
            return
        if state == _ACKNOWLEDGED:
            return  # installed already (into another module): it stays so; this install's error is the news
        if state not in (_RELEASED, _REJECTED):
            self.reject(manifest.update_id, f"{type(exc).__name__}: {exc}")

    def _acknowledged(self, manifest: WeightManifest) -> None:
        if self._state.get(manifest.update_id) != _ACKNOWLEDGED:  # (installed again: into a second module)
            self.acknowledge(manifest.update_id)
        self.installed_version = manifest.version
        self.installed_from = manifest.publisher_pid

    def _installed(self, manifest: WeightManifest, model: torch.nn.Module, alias: bool) -> list[str]:
        """Record the install into ``model``; the updates no module views any more, which the caller releases.

        ``model`` stops viewing what it viewed (a copying install gives its
        targets storage of their own) and, aliasing, views this update;
        another module's view is its own. An update whose last viewer moved
        on, or was garbage-collected, is released; this one, copied, is the
        caller's to release.
        """
        self._acknowledged(manifest)
        for modules in self._viewers.values():
            modules.discard(model)
        if alias:
            self._viewers.setdefault(manifest.update_id, weakref.WeakSet()).add(model)
        unviewed = [update_id for update_id, modules in self._viewers.items() if not modules]
        for update_id in unviewed:
            del self._viewers[update_id]
        return [update_id for update_id in unviewed if update_id != manifest.update_id]

    def _owing(self, replaced: list[str]) -> list[str]:
        """``replaced``, each owed until it is let go: should one release fail, the next release makes the rest."""
        for update_id in replaced:
            self._owed.setdefault(update_id, None)
        return replaced

    def holds_alias(self, update_id: str) -> bool:
        """True while a module's parameters are views of ``update_id``'s storage."""
        return bool(self._viewers.get(update_id))

    def acknowledge(self, update_id: str) -> None:
        """The update is fully installed."""
        state = self._state.get(update_id)
        if state != _IMPORTED:
            raise LifecycleError(
                f"cannot acknowledge update {update_id} before it is imported (it is {state or 'unknown'})"
            )
        self._set(update_id, _ACKNOWLEDGED)

    def reject(self, update_id: str, reason: str) -> None:
        """The update will not be used (failed install, stale, superseded)."""
        state = self._state.get(update_id)
        if state in (_ACKNOWLEDGED, _RELEASED):
            raise LifecycleError(f"cannot reject update {update_id}: it is {state}")
        self._reasons[update_id] = reason
        self._set(update_id, _REJECTED)

    def rejection_reason(self, update_id: str) -> str | None:
        return self._reasons.get(update_id)

    def release(self, update_id: str, transport: str | None = None) -> None:
        """Drop the update's storage; its tensors must not be used afterwards.

        Releases cut short earlier (see :meth:`release_async`) are made next,
        unless an event loop runs on this thread: there a ``cuda-ipc`` release
        would wait for the GPU on it, so :meth:`release_async` makes them.
        """
        self._release_one(update_id, transport)
        if self._owed and not loop_running():
            for owed, owed_transport in list(self._owed.items()):
                try:
                    self._release_one(owed, owed_transport)
                except Exception as exc:  # (still owed: the next release tries again)
                    log.warning("weights: releasing update %s, cut short before, failed again: %s", owed, exc)

    async def release_async(self, update_id: str, transport: str | None = None) -> None:
        """:meth:`release` for code on an event loop: a ``cuda-ipc`` reader's wait for the GPU's reads is awaited.

        Cancelled, or given up on a GPU whose reads did not finish, the update
        stays held and is owed: the next release of this consumer makes it.
        """
        await self._release_one_async(update_id, transport)
        for owed, owed_transport in list(self._owed.items()):
            try:
                await self._release_one_async(owed, owed_transport)
            except Exception as exc:  # (still owed: the next release tries again)
                log.warning("weights: releasing update %s, cut short before, failed again: %s", owed, exc)

    def _release_one(self, update_id: str, transport: str | None) -> None:
        readers = self._releasing(update_id, transport)
        try:
            for reader in readers or ():
                reader.release(update_id)
        except BaseException:
            self._owed[update_id] = transport
            raise
        self._released(update_id, readers)

    async def _release_one_async(self, update_id: str, transport: str | None) -> None:
        readers = self._releasing(update_id, transport)
        try:
            for reader in readers or ():
                await release_async(reader, update_id)
        except BaseException:
            self._owed[update_id] = transport
            raise
        self._released(update_id, readers)

    def _released(self, update_id: str, readers: list[Reader] | None) -> None:
        self._owed.pop(update_id, None)
        if readers is not None:
            self._set(update_id, _RELEASED)

    def _releasing(self, update_id: str, transport: str | None) -> list[Reader] | None:
        """Forget the update's tensors; the readers to release it from (None if it was released already)."""
        if self._state.get(update_id) == _RELEASED:
            return None
        self._viewers.pop(update_id, None)
        self._tensors.pop(update_id, None)
        return [reader for name, reader in self._readers.items() if transport is None or name == transport]

    def _set(self, update_id: str, state: str) -> None:
        self._state[update_id] = state
        self._state.move_to_end(update_id)
        while len(self._state) > self._history:
            old, old_state = self._state.popitem(last=False)
            if old_state != _RELEASED:  # never forget something still held
                self._state[old] = old_state
                break
            self._reasons.pop(old, None)

    def close(self) -> None:
        """Release every update still held and close the readers (on an event loop: :meth:`close_async`)."""
        try:
            for update_id, state in list(self._state.items()):
                if state != _RELEASED:
                    with contextlib.suppress(Exception):
                        self.release(update_id)
        finally:  # (a Ctrl-C in a release's wait: the readers, their mappings and the pidfds close all the same)
            self._close_readers()

    async def close_async(self) -> None:
        """:meth:`close` for code on an event loop: each ``cuda-ipc`` wait for the GPU's reads is awaited."""
        try:
            for update_id, state in list(self._state.items()):
                if state != _RELEASED:
                    with contextlib.suppress(Exception):
                        await self.release_async(update_id)
        finally:  # (cancelled meanwhile: the readers close all the same)
            readers = self._take_readers()
            try:
                if self._owed:  # a release cut short (cancelled, the GPU's reads late): its reader's close waits
                    await to_thread_to_the_end(_close_all, readers)  # for the GPU, on a worker thread
                else:
                    _close_all(readers)
            finally:
                self.publishers.close()

    def _close_readers(self) -> None:
        try:
            _close_all(self._take_readers())
        finally:
            self.publishers.close()

    def _take_readers(self) -> list[Reader]:
        readers = list(self._readers.values())
        self._readers.clear()
        return readers
