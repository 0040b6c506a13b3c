"""The code's shape (issue 62): no function of the library is over MAX_FUNCTION_LINES lines,
and no package imports another package's private names (`_name` or `_module.py`); what a
package shares is public. AST only: cheap, no jax."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxrl_cache", "kernels_pallas")
MAX_FUNCTION_LINES = 80
# Functions still over the limit, by "path::name". Keep this list short and shrinking.
LONG_FUNCTIONS: set = set()


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT), ast.parse(path.read_text(), str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package(module: str) -> str:
    """The package a dotted module name belongs to: jaxrl_cache's subpackages (rl, rollout,
    models, ...) are packages of their own; its top-level modules form one."""
    parts = module.split(".")
    if parts[0] == "jaxrl_cache" and len(parts) > 1 and (ROOT / "jaxrl_cache" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_function_is_longer_than_the_limit():
    long = {}
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.as_posix()}::{node.name}"] = lines
    over = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them): {over}"
    fixed = LONG_FUNCTIONS - set(long)
    assert not fixed, f"now within {MAX_FUNCTION_LINES} lines: drop from LONG_FUNCTIONS: {fixed}"


def _private_imports(path: pathlib.Path, tree) -> list[str]:
    module = _module_of(path)
    mine = _package(module if path.name != "__init__.py" else module + ".x")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                is_module = (ROOT.joinpath(*full.split(".")).is_dir()
                             or ROOT.joinpath(*full.split(".")).with_suffix(".py").exists())
                theirs = _package(full if is_module else node.module)
                if theirs != mine and (any(map(_private, full.split(".")))):
                    found.append(f"{path.as_posix()}:{node.lineno}: from {node.module} "
                                 f"import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES and _package(alias.name) != mine \
                        and any(map(_private, alias.name.split("."))):
                    found.append(f"{path.as_posix()}:{node.lineno}: import {alias.name}")
    return found


def test_packages_import_only_each_others_public_names():
    found = [line for path, tree in _sources() for line in _private_imports(path, tree)]
    assert not found, "private names imported across packages:\n" + "\n".join(found)


def test_the_private_import_check_sees_one():
    tree = ast.parse("from kernels_pallas._common import is_power_of_2\n"
                     "from jaxrl_cache.rl.loss import policy_loss\n"
                     "from jaxrl_cache.rollout.runner import _packed\n")
    found = _private_imports(pathlib.Path("jaxrl_cache/rl/audit.py"), tree)
    assert [line.split(": ", 1)[1] for line in found] == [
        "from kernels_pallas._common import is_power_of_2",
        "from jaxrl_cache.rollout.runner import _packed"]
    inside = ast.parse("from kernels_pallas._common import MASK_VALUE\n")
    assert not _private_imports(pathlib.Path("kernels_pallas/decode.py"), inside)
