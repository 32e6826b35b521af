"""The package's imports against shared/DESIGN.md's layers (issue 13), walked from the source:

* no import cycle among lowbit's modules at module level;
* no module-level import of a higher layer, except the ones listed (integrations adapt the DDP hook);
* lowbit imports inside function bodies only in the modules listed, and no more of them than counted
  here: a ratchet, to be lowered to zero as study and perfmodel are untangled (optional dependencies
  are imported through lowbit.extras, at module level);
* the library and the lab (issue 42 item 3): the lab's packages live under lowbit.lab (a module's layer
  there is the package below lowbit.lab: lowbit.lab.study.train is "study"), and nothing outside
  lowbit.lab imports it or names one of its modules in a string, but ``python -m lowbit``'s entry.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

#: DESIGN.md's drawing, top (imports everything below) to bottom.
LAYER = {"__init__": 10, "__main__": 10, "lab": 10, "cli": 9, "study": 8, "codec_report": 8, "bench": 8, "perfmodel": 7, "ddp": 6, "baselines": 6, "fsdp": 6, "parallel": 6, "localsgd": 6, "auto": 5.5, "integrations": 5, "policy": 4, "choose": 4, "timeline": 3.5, "comm": 3,
         "feedback": 2, "codecs": 1, "kernels": 0, "models": 0, "data": 0, "env": -1, "launch": -1, "extras": -1, "_version": -2}
UPWARD_ALLOWED = {("lowbit.integrations.accelerate", "lowbit.ddp"), ("lowbit.integrations.lightning", "lowbit.ddp"),
                  ("lowbit.integrations._register", "lowbit.ddp"), ("lowbit.integrations._register", "lowbit.fsdp"),
                  ("lowbit.integrations.torchtitan", "lowbit.fsdp")}
#: lowbit imports inside functions, per top-level package (2026-11-26: 53 in all; 30 after the commands moved to cli/ and perfmodel lost 5; 3 once study hoisted its 24 and perfmodel lost its calibrate <-> validate cycle and its upward read of study results; 2 once codecs.base stopped importing its subclasses)
INNER_MAX = {"__init__": 2}
#: The compiled kernel backends (issue 13 item 3): packages of one module per codec family, each importing
#: its package's common module and the kernels' shared modules, never another family.
KERNEL_BACKENDS = ("lowbit.kernels.triton", "lowbit.kernels.numba")
KERNEL_FAMILIES = ("qsgd", "onebit", "dettmers")


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, tuple[ast.Module, Path]]:
    """Every module of the package, parsed once per session (the tests only read the trees)."""
    out = {}
    for f in (SRC / "lowbit").rglob("*.py"):
        name = ".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        out[name] = (ast.parse(f.read_text()), f)
    return out


def _layer(mod: str) -> str:
    """The layer of a module: the top-level package or module it lives in (``lowbit.ddp.state``: ddp), and
    for the lab the package under ``lowbit.lab`` (``lowbit.lab.study.train``: study)."""
    parts = mod.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[2] if parts[1] == "lab" and len(parts) > 2 else parts[1]


def _top_level_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                names.append(sub.module)
                names += [f"{sub.module}.{a.name}" for a in sub.names]
            elif isinstance(sub, ast.Import):
                names += [a.name for a in sub.names]
    return [n for n in names if n.startswith("lowbit")]


def test_no_cycles_and_no_upward_imports() -> None:
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    upward = set()
    for name, (tree, _) in mods.items():
        for imp in _top_level_imports(tree):
            target = imp if imp in mods else imp.rsplit(".", 1)[0]
            if target not in mods or target == name:
                continue
            graph[name].add(target)
            a, b = _layer(name), _layer(target)
            if a != b and LAYER.get(b, 0) > LAYER.get(a, 0):
                upward.add((name, target))
    assert upward <= UPWARD_ALLOWED, sorted(upward - UPWARD_ALLOWED)
    # cycles: depth-first search over module-level edges (a package's __init__ importing its own
    # submodules is how packages work; edges into a package's own __init__ from its members are not cycles)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph.get(m, ()):
            if m.startswith(n + ".") or n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m)


def test_inner_imports_do_not_grow() -> None:
    counts: dict[str, int] = defaultdict(int)
    for name, (tree, _) in _modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    mod = (node.module or "") if isinstance(node, ast.ImportFrom) else \
                        (node.names[0].name if isinstance(node, ast.Import) else "")
                    if mod.startswith("lowbit"):
                        counts[_layer(name)] += 1
    for pkg, n in counts.items():
        assert n <= INNER_MAX.get(pkg, 0), (pkg, n, INNER_MAX.get(pkg, 0))


def test_kernel_families_import_only_common() -> None:
    mods = _modules()
    for pkg in KERNEL_BACKENDS:
        shared = {f"{pkg}.common", "lowbit.kernels", "lowbit.kernels.reference", "lowbit.kernels.dettmers_tables"}
        for fam in KERNEL_FAMILIES:
            name = f"{pkg}.{fam}"
            assert name in mods, name
            imports = {i for i in _top_level_imports(mods[name][0]) if i in mods}
            assert imports <= shared, (name, sorted(imports - shared))


def test_the_integrations_do_not_import_each_other() -> None:
    """DDP and FSDP share what lies below them (comm's agreement, registration, groups, graphs) and
    neither imports the other: using FSDP never loads the DDP hook and its tuner (issue 42)."""
    for mod, other in (("lowbit.fsdp", "lowbit.ddp"), ("lowbit.ddp", "lowbit.fsdp"),
                       ("lowbit.auto.fsdp_tuner", "lowbit.ddp"), ("lowbit.auto.fsdp_tuner", "lowbit.auto.ddp_tuner"),
                       ("lowbit.auto.ddp_tuner", "lowbit.fsdp"), ("lowbit.auto.ddp_tuner", "lowbit.auto.fsdp_tuner"),
                       ("lowbit.fsdp", "lowbit.auto.ddp_tuner"), ("lowbit.ddp", "lowbit.auto.fsdp_tuner"),
                       ("lowbit.auto", "lowbit.auto.ddp_tuner"), ("lowbit.auto", "lowbit.auto.fsdp_tuner")):
        tree, _ = _modules()[mod]
        assert not any(n == other or n.startswith(other + ".") for n in _top_level_imports(tree)), (mod, other)


#: the lab (issue 42 item 3): what a training script never needs, the packages under lowbit.lab
LAB = ("study", "perfmodel", "cli", "data", "models", "baselines", "codec_report", "bench")
#: the library a training script imports (CONTRIBUTING.md, "Layers"): every top-level module but lowbit.lab
CORE = ("codecs", "kernels", "comm", "feedback", "policy", "timeline", "choose", "auto", "ddp", "fsdp",
        "parallel", "localsgd", "integrations", "env", "launch", "extras", "_version", "_forkserver_freeze")
#: the only imports of the lab from outside it: ``python -m lowbit`` runs the command
LAB_IMPORTS_ALLOWED = {("lowbit.__main__", "lowbit.lab.cli")}
#: a string that names a module of the lab (an importlib or preload name): ``lowbit.lab``, ``lowbit.lab.x.y``
_LAB_NAME = re.compile(r"lowbit\.lab(\.\w*)*")


def _in_lab(mod: str) -> bool:
    return mod == "lowbit.lab" or mod.startswith("lowbit.lab.")


def _imported(name: str, node: ast.AST, is_package: bool) -> list[str]:
    """The modules an import statement of module ``name`` names (relative imports resolved; for
    ``from a import b`` both ``a`` and ``a.b``, since ``b`` may be a submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def test_auto_imports_no_lab_and_no_private_names() -> None:
    """codec="auto" (lowbit.auto) is core: it never imports the lab; and neither it nor the integrations
    that adapt it import another module's private (underscore) names from it or through it (issue 42)."""
    mods = _modules()
    for name, (tree, _) in mods.items():
        auto = _layer(name) == "auto"
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lowbit")):
                continue
            if auto:
                assert not _in_lab(node.module), (name, node.module)
            if auto or _layer(node.module) == "auto":
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (name, node.module, private)


def _lab_references(name: str, tree: ast.Module, is_package: bool) -> list[tuple[str, str]]:
    """Every place module ``name`` names the lab: an import of it (at the top or inside a function,
    absolute or relative), or a string that is a lab module's name (importlib, a preload list)."""
    out = []
    for node in ast.walk(tree):
        out += [(name, m) for m in _imported(name, node, is_package) if _in_lab(m)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _LAB_NAME.fullmatch(node.value):
            out.append((name, repr(node.value)))
    return out


def test_nothing_outside_the_lab_imports_it() -> None:
    """The boundary between the library and the lab (issue 42 item 3): no module outside lowbit.lab
    imports it, at its top or inside a function, or names one of its modules in a string, so a training
    script that imports lowbit.ddp / lowbit.fsdp / lowbit.comm never loads the lab. The one exception is
    ``python -m lowbit`` (lowbit/__main__.py), the command's entry point."""
    bad = []
    for name, (tree, path) in _modules().items():
        if not _in_lab(name):
            bad += [(n, m) for n, m in _lab_references(name, tree, path.name == "__init__.py")
                    if not any(n == a and (m == b or m.startswith(b + ".")) for a, b in LAB_IMPORTS_ALLOWED)]
    assert not bad, bad


def test_the_boundary_check_sees_every_way_of_naming_the_lab() -> None:
    """The check above fails on each form a module could reach the lab with."""
    cases = {"from lowbit.lab.study import runner": "lowbit.lab.study", "import lowbit.lab.perfmodel": "lowbit.lab.perfmodel",
             "from lowbit import lab": "lowbit.lab", "from lowbit.lab import baselines": "lowbit.lab.baselines",
             "def f():\n    from ..lab.models import get_model": "lowbit.lab.models",
             "import importlib\nimportlib.import_module('lowbit.lab.cli')": "'lowbit.lab.cli'",
             "PRELOAD = ['torch', 'lowbit.lab.study.train']": "'lowbit.lab.study.train'"}
    for code, named in cases.items():
        found = [m for _, m in _lab_references("lowbit.comm.x", ast.parse(code), False)]
        assert named in found, (code, found)
    assert not _lab_references("lowbit.comm.x", ast.parse('"""Priced by lowbit.lab.perfmodel."""\nfrom ..ddp import x'), False)


def test_every_top_level_module_is_core_or_lab() -> None:
    """Each top-level module or package of lowbit is named on one side of the boundary, and the lab
    holds only the packages named in LAB."""
    tops = {name.split(".")[1] for name in _modules() if name.count(".") >= 1}
    unnamed = sorted(t for t in tops if t not in CORE and t not in ("lab", "__init__", "__main__"))
    assert not unnamed, f"name these in CORE, or move them under lowbit.lab: {unnamed}"
    lab = {name.split(".")[2] for name in _modules() if _in_lab(name) and name.count(".") >= 2}
    assert lab == set(LAB), sorted(lab ^ set(LAB))
    assert not set(CORE) & set(LAB)
