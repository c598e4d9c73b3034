"""The code's own habits, read from the source (no process started): imports sit at the top of each
module except where deferring one saves something, and imports point one way."""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# loaded only when a feature asks for them (the light-import rule: README, docs/environment.md)
EXTRAS = {
    "pydoc_data",  # 0.5 MB of text, for --dataset pydoc only
    "datasets",
    "deepspeed",
    "huggingface_hub",  # with transformers
    "intel_extension_for_pytorch",
    "matplotlib",
    "mpi4py",
    "oneccl_bindings_for_pytorch",
    "plotext",
    "rich",
    "safetensors",
    "sklearn",
    "tensorboard",
    "tokenizers",
    "torchinfo",
    "transformers",
    "wandb",
    "xarray",
}
HEAVY = {"torch", "numpy"}  # deferred only by modules that `import mmm` or `launch` load without them
# what `import torch` loads: importing them inside a function of a module that loads torch saves nothing
# (deeper submodules, e.g. torch.distributed.tensor, .checkpoint or .pipelining, load on first use)
WITH_TORCH = {"torch", "torch.nn", "torch.nn.functional", "torch.distributed", "torch.utils.checkpoint"}
# mmm's own modules imported inside a function: (the importer, the module it defers) and why
OWN_DEFERRED = {
    ("mmm.__main__", "mmm.parallel"): "the smoke test parses its flags before torch loads",
    ("mmm.data", "mmm.data.tokens"): "token files only for --dataset bin/hf",
    ("mmm.data.__main__", "mmm.data.prepare"): "the prepare command only when asked for",
    ("mmm.data.prepare", "mmm.data.tokens"): "token files only when asked for",
}
# the layers, lowest first: a module may import its own layer and those below, never above. mmm.models
# is plain single-device code at the bottom, but for a model's parts of the library beside it
# (MODEL_PARTS: the parallel layer) and its recipe (the training layer): see _layer
LAYERS = [
    ("mmm.models",),
    ("mmm.errors", "mmm.env", "mmm.files", "mmm.log", "mmm.cli", "mmm.faults", "mmm.dist"),
    ("mmm.parallel", "mmm.data", "mmm.measure", "mmm.flops"),
    ("mmm.history", "mmm.tracking", "mmm.training"),
    ("mmm.examples", "mmm.trainer", "mmm.plan", "mmm.verify", "mmm.launch", "mmm.__main__"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "mmm").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path):
    """(node, inside a function, inside a try, the modules it names) for every import of ``path``."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "module", None) == "__future__":
            continue
        in_function = in_try = type_checking = False
        up = parents.get(node)
        while up is not None:
            in_function |= isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
            in_try |= isinstance(up, ast.Try)
            type_checking |= isinstance(up, ast.If) and "TYPE_CHECKING" in ast.unparse(up.test)
            up = parents.get(up)
        if type_checking:
            continue
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import; name the module in full"
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            names = [a.name for a in node.names]
        yield node, in_function, in_try, names


def _own(name: str) -> str | None:
    """The mmm module an imported name is (``mmm.parallel.init_mesh`` -> ``mmm.parallel``), if any."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@cache
def _top_level_own(module: str) -> frozenset[str]:
    deps = set()
    for node, in_function, _, names in _imports(MODULES[module]):
        if not in_function:
            deps |= {m for m in map(_own, names) if m}
    parts = module.split(".")  # importing a.b.c runs a/__init__ and a/b/__init__ first
    deps |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES}
    return frozenset(deps - {module})


@cache
def _direct_heavy(module: str) -> frozenset[str]:
    out = set()
    for _, in_function, in_try, names in _imports(MODULES[module]):
        if not in_function and not in_try:
            out |= {names[0].split(".")[0]} & HEAVY
    return frozenset(out)


@cache
def _loads_heavy(module: str) -> frozenset[str]:
    """torch/numpy that importing ``module`` loads anyway (its own top-level imports and theirs)."""
    out, todo, seen = set(), [module], {module}
    while todo:
        current = todo.pop()
        out |= _direct_heavy(current)
        for dep in _top_level_own(current) - seen:
            seen.add(dep)
            todo.append(dep)
    if "torch" in out:
        out.add("numpy")  # torch imports numpy
    return frozenset(out)


def test_imports_inside_functions_defer_something():
    """An import inside a function must save something: an optional extra, torch or numpy in a module
    that does not load them anyway, or one of mmm's own modules named in OWN_DEFERRED with its reason."""
    needless = []
    for module, path in MODULES.items():
        heavy = _loads_heavy(module)
        for node, in_function, in_try, names in _imports(path):
            if not in_function or in_try:
                continue
            top = names[0].split(".")[0]
            if top in EXTRAS or (top in HEAVY and top not in heavy):
                continue
            if top == "torch" and names[0] not in WITH_TORCH:
                continue
            if top == "mmm" and all((module, dep) in OWN_DEFERRED for dep in {_own(n) for n in names} - {"mmm"}):
                continue
            if top in sys.stdlib_module_names and top == "ctypes":  # loaded at the moment of exit only
                continue
            needless.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert not needless, "imports inside functions that defer nothing; move them to the top:\n" + "\n".join(needless)


def _is_recipe(module: str) -> bool:
    """A model's recipe (``mmm.models.<model>.recipe``) sits beside its model, so that a model is one folder,
    but in the training layer: it uses the trainer's configs, data and checkpoints
    (mmm.training.recipe); nothing in mmm.models imports it, so a model stays plain single-device code."""
    return module.startswith("mmm.models.") and module.endswith(".recipe")


# a model's parts of the library, beside it (mmm.models.<model>.<part>): its TP plan and shape checks, its
# context-parallel hook, its Hugging Face checkpoint mapping, its closed-form memory estimate
MODEL_PARTS = ("tp", "context", "hf", "estimate")


def _layer(module: str) -> int:
    if _is_recipe(module):
        return LAYERS.index(("mmm.history", "mmm.tracking", "mmm.training"))
    parts = module.split(".")
    if parts[:2] == ["mmm", "models"] and len(parts) == 4 and parts[3] in MODEL_PARTS:
        return LAYERS.index(("mmm.parallel", "mmm.data", "mmm.measure", "mmm.flops"))
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def test_imports_point_one_way():
    """bootstrap -> parallel (the library) -> training loop and History -> trainers, planner, launcher:
    no module imports one of a higher layer, not even inside a function."""
    upward = []
    for module, path in MODULES.items():
        if module == "mmm":
            continue
        for node, _, _, names in _imports(path):
            for dep in {m for m in map(_own, names) if m and m != "mmm"}:
                if _layer(dep) > _layer(module):
                    upward.append(f"{path.relative_to(SRC)}:{node.lineno}: {module} imports {dep}")
    assert not upward, "\n".join(upward)


def _graph() -> dict[str, set[str]]:
    """Who imports whom among mmm's modules, top-level or in a function (``from a import b`` of a
    submodule ``b`` names ``a.b``, not ``a``)."""
    out = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for _, _, _, names in _imports(path):
            named = {_own(n) for n in names[1:]} or {_own(names[0])}
            if any(_own(n) == names[0] for n in names[1:]):  # a name that is not a submodule of names[0]
                named.add(names[0])
            out[module] |= {m for m in named if m and m not in (module, "mmm")}
    return out


def test_no_import_circles():
    """No module reaches itself through imports, not even through one inside a function (one strongly
    connected component per module, by Tarjan's algorithm)."""
    graph, index, low, stack, on_stack, circles = _graph(), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(" <-> ".join(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "modules that import each other:\n" + "\n".join(circles)
