"""Weight updates from a trainer to rollout actors: versioned manifests, zero-copy storage.

A :class:`WeightPublisher` turns a model (or state_dict) into a
:class:`WeightManifest`: a small frozen record naming one complete update
(id, version, the tensors' specs as a table of columns, transport and handle). The manifest travels
through any port or endpoint; the tensor bytes never do. A
:class:`WeightConsumer` imports the update (views over shared memory or a
device slot where the transport allows), installs it into a module with at
most one copy, and acknowledges or rejects it. Both sides release it when done.

Lifecycle, per side::

    publisher:  published ──────────────────────────────► released
    consumer:   imported ──► acknowledged | rejected ──► released

:class:`WeightInbox` is the common actor pattern: an ``update_weights``
endpoint that only enqueues the manifest, and a loop that installs the
newest one, releasing every superseded one. :class:`ReceivesWeights` is an
actor base class that provides exactly that endpoint.
"""

from ..tensors import TensorSpec
from ._consumer import WeightConsumer
from ._inbox import ReceivesWeights, WeightInbox
from ._manifest import WeightManifest, available_transports
from ._publisher import WeightPublisher, join_publish
from ._spec_table import SpecTable

__all__ = [
    "ReceivesWeights",
    "SpecTable",
    "TensorSpec",
    "WeightConsumer",
    "WeightInbox",
    "WeightManifest",
    "WeightPublisher",
    "available_transports",
    "join_publish",
]
