"""The package's layers: no module imports a layer above its own.

The table below is the layout, bottom to top (docs/architecture.md, "Layers",
says why each layer sits where it does). A module belongs to the layer whose
package is the longest prefix of its name. Every import counts, wherever it is
written: at module level, under ``TYPE_CHECKING``, inside a function (a lazy
import is still a dependency, only a later one). A new package goes into the
table before its first module lands; a new import that runs up the layers is a
design question (move the thing down, or pass it in), never an exception here.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pcp_p2p"

# Bottom to top. A module may import its own layer and any layer below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pcp_p2p", "pcp_p2p.core"),  # the package root (its version) and what every layer uses
    ("pcp_p2p.wire",),  # the codec and framing
    ("pcp_p2p.dht",),  # signed records, Kademlia lookups
    ("pcp_p2p.net",),  # budgets, connectivity, SWIM membership (member records are DHT records)
    ("pcp_p2p.blob",),  # content-addressed blobs over the network
    ("pcp_p2p.compile",),  # JAX → StableHLO → IREE artifacts, signed manifests
    ("pcp_p2p.executor",),  # running artifacts in a crashable child
    ("pcp_p2p.diloco", "pcp_p2p.diloco.algorithm"),  # the numbers (the diloco package itself is a docstring)
    ("pcp_p2p.diloco.protocol",),  # sans-IO round machines, messages, records
    ("pcp_p2p.node",),  # the node that wires the layers below (and knows every record kind)
    ("pcp_p2p.diloco.run",),  # one run on one node
    ("pcp_p2p.cluster",),  # worker groups under MPI
    ("pcp_p2p.export",),  # ONNX export, wasm guest, pcp generate
    ("pcp_p2p.tui",),  # the dashboard
    ("pcp_p2p.testing",),  # harnesses, simulators, attackers: may import anything below
    ("pcp_p2p.commands",),  # pcp node join, pcp swarm: assemble everything
    ("pcp_p2p.cli",),  # the command line
)
EXACT = {"pcp_p2p", "pcp_p2p.diloco"}  # packages whose subpackages sit in other layers

LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    """The layer package that holds ``module``: the longest listed prefix (whole components)."""
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        if head in LEVEL and (head not in EXACT or head == module):
            return head
    return None


def imports_of(module: str, path: Path) -> list[tuple[str, int]]:
    """Every pcp_p2p module ``module`` imports, with the line, resolved to the module itself."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for a in node.names:
                sub = f"{source}.{a.name}"
                out.append((sub if sub in MODULES else source, node.lineno))
    return [(m, line) for m, line in out if m == "pcp_p2p" or m.startswith("pcp_p2p.")]


def test_every_module_sits_in_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add their package to LAYERS): {unplaced}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    bad = []
    for module, path in MODULES.items():
        own = layer_of(module)
        if own is None:
            continue
        for target, line in imports_of(module, path):
            theirs = layer_of(target)
            if theirs is not None and LEVEL[theirs] > LEVEL[own]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} ({own}) imports {target} ({theirs})")
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_nothing_outside_testing_imports_it() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}: {module} imports {target}"
           for module, path in MODULES.items() if layer_of(module) != "pcp_p2p.testing"
           for target, line in imports_of(module, path) if layer_of(target) == "pcp_p2p.testing"]
    assert not bad, "\n".join(bad)


def test_no_two_modules_share_a_name() -> None:
    names = Counter(p.name for p in MODULES.values() if p.name != "__init__.py")
    assert not [n for n, k in names.items() if k > 1], {n: k for n, k in names.items() if k > 1}


@pytest.mark.parametrize("layer", sorted(LEVEL))
def test_every_layer_is_a_package(layer: str) -> None:
    assert layer in MODULES, f"{layer} is in LAYERS but is not a module or package"
