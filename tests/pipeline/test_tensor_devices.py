"""Every tensor the pipeline creates names the device it is created on.

A factory such as ``torch.tensor(x)`` or ``torch.randint(..., generator=g)``
without ``device=`` makes a CPU tensor whatever the model's device, which
works on a CPU machine and fails at the first GPU run ("Expected all
tensors to be on the same device"; "Expected a 'cpu' device type for
generator"). This test reads the pipeline's source and lists every such
call: each must say where its tensor lives (``device=...``, ``"cpu"`` where
the CPU is meant). Factories that follow an input tensor (``*_like``,
``multinomial``, methods of a tensor) inherit its device and are not listed.
"""

from __future__ import annotations

import ast
import pathlib

import pipeline

#: torch functions that create a tensor (or a generator) on the default device unless told otherwise.
FACTORIES = {
    "Generator",
    "arange",
    "as_tensor",
    "empty",
    "eye",
    "full",
    "linspace",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "tensor",
    "zeros",
}
PACKAGE = pathlib.Path(pipeline.__file__).parent


def calls_without_device(source: str) -> list[tuple[int, str]]:
    """(line, call) of each ``torch.<factory>(...)`` in ``source`` that passes no ``device``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if not (isinstance(owner, ast.Name) and owner.id == "torch" and node.func.attr in FACTORIES):
            continue
        if not any(keyword.arg in ("device", None) for keyword in node.keywords):  # None: **kwargs may carry it
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_finds_a_factory_without_a_device():
    source = "import torch\na = torch.tensor([1])\nb = torch.zeros(3, device=x.device)\nc = torch.randint(0, 9, (1,), generator=g)\n"
    assert [line for line, _ in calls_without_device(source)] == [2, 4]


def test_every_tensor_factory_in_the_pipeline_names_its_device():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {call}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, call in calls_without_device(path.read_text())
    ]
    assert not offenders, "tensor factories without device=:\n" + "\n".join(offenders)
