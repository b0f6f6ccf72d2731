"""megatron/ is built in layers: its import graph (every import, TYPE_CHECKING blocks included) has no cycle, every
import runs down the declared LAYERS, and megatron is imported at module level only — so every module can be read,
tested and imported on its own, and the layers in DESIGN.md are the code's, not a wish."""

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(nodes, modules: Set[str]) -> Set[str]:
    """The megatron modules the import statements among `nodes` name."""
    found: Set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return {name for name in found if name in modules}


def module_level_imports(path: Path, modules: Set[str]) -> Set[str]:
    """The megatron modules `path` imports at module level (also under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body: List[ast.stmt] = []
    for node in tree.body:
        body += node.body if isinstance(node, ast.If) else [node]
    return imported_modules(body, modules)


def import_graph() -> Dict[str, Set[str]]:
    paths = sorted((REPO / "megatron").rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): module_level_imports(p, modules) - {module_name(p)} for p in paths}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}  # 1 on the stack, 2 done
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_megatron_has_no_import_cycle():
    graph = import_graph()
    assert "megatron.neox_arguments.arguments" in graph and graph["megatron.neox_arguments.arguments"]
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def all_imports(path: Path, modules: Set[str]) -> Set[str]:
    """The megatron modules `path` imports anywhere: at module level and inside functions, with the packages whose
    ``__init__`` Python runs to import them (not `path`'s own packages: they are imported before it)."""
    found = imported_modules(ast.walk(ast.parse(path.read_text(encoding="utf-8"))), modules)
    own = module_name(path)
    parents = {".".join(name.split(".")[:i]) for name in found for i in range(2, name.count(".") + 1)}
    return found | {p for p in parents & modules if not own.startswith(p + ".")}


def full_import_graph() -> Dict[str, Set[str]]:
    paths = sorted((REPO / "megatron").rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): all_imports(p, modules) - {module_name(p)} for p in paths}


def circles(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[Set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_circles_through_any_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_megatron_has_no_import_circle():
    """Imports inside functions count too (a circle through them still ties the modules together), and so does the
    package ``__init__`` that importing ``a.b.c`` runs first."""
    circles_found = circles(full_import_graph())
    assert not circles_found, f"import circles: {[sorted(c) for c in circles_found]}"


LAYERS: List[Tuple[str, ...]] = [
    ("megatron.errors",),
    ("megatron.utils",),
    ("megatron.fused_kernels", "megatron.tokenizer"),
    ("megatron.mpu",),
    ("megatron.mup",),
    ("megatron.data",),
    ("megatron.training_schedule",),
    ("megatron.model",),
    ("megatron.optim",),
    ("megatron.checkpoint",),
    ("megatron.observability",),
    ("megatron.neox_arguments",),
    ("megatron.initialize",),
    ("megatron.inference",),
    ("megatron.post_training",),
    ("megatron.evaluation",),
    ("megatron.training",),
    ("megatron.checkpoint_conversion",),
    ("megatron.launch",),
]
"""megatron's packages (and its few top-level modules), bottom first: each may import only those on a lower line
(and itself); those on one line know nothing of each other. DESIGN.md and each package's __init__ say the same."""


def unit_of(module: str) -> str:
    """The LAYERS entry a module belongs to (``megatron.model.moe.layer`` -> ``megatron.model``)."""
    return ".".join(module.split(".")[:2])


def layer_of(unit: str) -> int:
    for index, layer in enumerate(LAYERS):
        if unit in layer:
            return index
    raise AssertionError(f"{unit} is in no layer of tests/test_package_layout.LAYERS: add it there and to docs/architecture.md")


def test_every_package_is_in_a_layer():
    assert {unit_of(m) for m in full_import_graph()} - {"megatron"} == {u for layer in LAYERS for u in layer}


def test_megatron_imports_only_downward():
    against = sorted(f"{module} imports {target}" for module, targets in full_import_graph().items()
                     for target in targets if unit_of(module) != unit_of(target) and module != "megatron"
                     and layer_of(unit_of(target)) >= layer_of(unit_of(module)))
    assert not against, "imports against tests/test_package_layout.LAYERS:\n" + "\n".join(against)


def needs_an_optional_package(module: str) -> bool:
    """Whether megatron module ``module`` imports, at module level and unguarded, a package outside requirements.txt
    (megatron.evaluation.adapter subclasses lm_eval's LM): importing it is importing that optional package."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.is_file():
        return False
    core = core_packages()
    roots = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return any(root not in core and root not in sys.stdlib_module_names and root != "megatron" for root in roots)


def test_megatron_imports_megatron_at_module_level_only():
    """An import of megatron inside a function hides a dependency from the reader (and from these checks' first
    line of defence, the import itself); only optional third-party packages are imported where they are used, and
    so a megatron module that needs one (needs_an_optional_package)."""
    inside = []
    for path in sorted((REPO / "megatron").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(node) for node in tree.body}
        top |= {id(node) for block in tree.body if isinstance(block, ast.If) for node in block.body}
        for node in ast.walk(tree):
            if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any((name == "megatron" or name.startswith("megatron.")) and not needs_an_optional_package(name)
                   for name in names):
                inside.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not inside, f"megatron imported inside functions: {inside}"


def test_the_layer_check_sees_a_package_init():
    graph = full_import_graph()
    assert {"megatron.model", "megatron.model.config"} <= graph["megatron.checkpoint.neox_checkpoint"]
    assert "megatron.model" not in graph["megatron.model.gpt2_model"]  # its own package is imported before it


def declared_imports(unit: str) -> Set[str]:
    """The units a package's ``__init__`` (or a top-level module's) docstring says it may import: its last line
    ``May import: megatron.a, b, c.`` (or ``nothing of megatron`` / ``every package of megatron but x and y``)."""
    path = REPO / unit.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    lines = [line for line in doc.splitlines() if line.startswith("May import:")]
    assert lines, f"{path.relative_to(REPO)}: its docstring does not say what it may import ('May import: ...')"
    text = " ".join(lines[-1][len("May import:"):].split()).rstrip(".")
    units = {u for layer in LAYERS for u in layer}
    if text == "nothing of megatron":
        return set()
    if text.startswith("every package of megatron but "):
        return {u for u in units if layer_of(u) < layer_of(unit)} - {
            f"megatron.{name}" for name in text[len("every package of megatron but "):].split(" and ")}
    return {name if name.startswith("megatron.") else f"megatron.{name}" for name in text.split(", ")}


def test_each_package_says_what_it_may_import_and_keeps_to_it():
    graph = full_import_graph()
    problems = []
    for layer in LAYERS:
        for unit in layer:
            declared = declared_imports(unit)
            lower = {u for below in LAYERS[:layer_of(unit)] for u in below}
            actual = {unit_of(t) for m, targets in graph.items() if unit_of(m) == unit for t in targets} - {unit}
            if declared - lower:
                problems.append(f"{unit} says it may import {sorted(declared - lower)}, which are not below it")
            if actual - declared:
                problems.append(f"{unit} imports {sorted(actual - declared)}, which its docstring does not allow")
    assert not problems, "\n".join(problems)


def megatron_entries() -> Set[str]:
    """``name/`` for each package directly under megatron/, ``name.py`` for each module there but __init__."""
    root = REPO / "megatron"
    return ({f"{p.name}/" for p in root.iterdir() if (p / "__init__.py").is_file()}
            | {p.name for p in root.glob("*.py") if p.name != "__init__.py"})


def test_at_most_five_modules_directly_under_megatron():
    modules = sorted(p.name for p in (REPO / "megatron").glob("*.py"))
    assert len(modules) <= 5, modules


def test_the_architecture_page_matches_the_tree():
    """docs/architecture.md's table names every package and top-level module of megatron/, in LAYERS order (the
    README keeps only the top-level folders and points there)."""
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {cell.strip().strip("`")[len("megatron/"):] for line in page.splitlines() if line.startswith("| ")
            for cell in line.split("|")[2:3] if cell.strip().startswith("`megatron/")}
    assert rows == megatron_entries(), (rows ^ megatron_entries())
    cells = [line.split("|")[2].strip() for line in page.splitlines() if line.startswith("| ")]
    order = [f"megatron.{cell.strip('`')[len('megatron/'):].rstrip('/').removesuffix('.py')}" for cell in cells
             if cell.startswith("`megatron/")]
    assert [layer_of(unit) for unit in order] == sorted(layer_of(unit) for unit in order), "docs order != LAYERS"


def core_packages() -> Set[str]:
    """The import names of requirements/requirements.txt (what every install has), and psutil (DeepSpeed's)."""
    names = {"pyyaml": "yaml"}
    found = {"psutil"}
    for line in (REPO / "requirements" / "requirements.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.split(r"[<>=!~\[ ]", line)[0].lower()
            found.add(names.get(name, name.replace("-", "_")))
    return found


def launcher_modules() -> Set[str]:
    """The megatron modules deepy.py imports: they keep torch, DeepSpeed and numpy for inside the functions that
    need them, so that the launcher starts in a fraction of a second (tests/launch/test_prelaunch.py)."""
    code = ("import sys, importlib.util; sys.argv = ['deepy.py']; "
            "spec = importlib.util.spec_from_file_location('deepy', 'deepy.py'); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "print(' '.join(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return set(out.split())


PLATFORM_ONLY = {"fcntl"}
"""Standard-library modules that exist only on some systems (fcntl: POSIX), imported where they are used."""
LAUNCHER_DEFERRED = {"torch", "deepspeed", "numpy"}


def guarded_imports(tree: ast.AST) -> Set[int]:
    """ids of the import statements inside ``try: ... except ImportError`` (the code handles their absence)."""
    guarded: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any("ImportError" in ast.dump(h.type) or "ModuleNotFoundError"
                                             in ast.dump(h.type) for h in node.handlers if h.type is not None):
            guarded |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return guarded


def test_only_optional_packages_are_imported_inside_functions():
    """Inside a function: an optional package (not in requirements.txt), one whose absence the code handles
    (``except ImportError``), a platform-only module, or torch / DeepSpeed / numpy in a module the launcher imports.
    Everything else at the top, where a reader sees what a module needs."""
    core, launcher = core_packages(), launcher_modules()
    inside = []
    for path in sorted((REPO / "megatron").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(node) for node in tree.body}
        top |= {id(node) for block in tree.body if isinstance(block, ast.If) for node in block.body}
        guarded, module = guarded_imports(tree), module_name(path)
        for node in ast.walk(tree):
            if id(node) in top or id(node) in guarded or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for root in {name.split(".")[0] for name in names} - {"megatron"}:  # megatron: the test above
                optional = root not in core and root not in sys.stdlib_module_names and root != "megatron"
                if optional or root in PLATFORM_ONLY or (module in launcher and root in LAUNCHER_DEFERRED):
                    continue
                inside.append(f"{path.relative_to(REPO)}:{node.lineno} imports {root}")
    assert not inside, "imports inside functions that belong at the top:\n" + "\n".join(inside)


def test_training_and_evaluation_import_without_the_optional_packages():
    """train.py imports the training loop, which imports the lm-eval harness: without lm-eval (installed by the eval
    extra only) both must still import, and the harness say what to install when eval_tasks asks for it. A fresh
    venv with the core install caught the loop importing lm_eval through the adapter."""
    code = ("import sys; sys.modules['lm_eval'] = None; "
            "import megatron.training.loop, megatron.evaluation.harness, megatron.inference.loading")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
