"""The architecture holds: the import contracts (service/pyproject.toml), each of which a planted
import breaks; docs/architecture.md's picture and module map match the code; and no module or
function grows past what a reader takes in at once."""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "service" / "vlserve"
CONFIG = ROOT / "service" / "pyproject.toml"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100

# lint-imports over another copy of the package: the editable install's finder would find this one.
LINT_A_COPY = """
import sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, sys.argv[1])
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))
"""


def lint(tree: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    if tree is None:
        command = [str(pathlib.Path(sys.executable).parent / "lint-imports"), "--config", str(CONFIG), "--no-cache"]
    else:
        command = [sys.executable, "-c", LINT_A_COPY, str(tree), str(CONFIG)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def contracts() -> list[dict]:
    return tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold():
    result = lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "%d kept, 0 broken" % len(contracts()) in result.stdout


# (module that gets the import, the import, the contract it breaks)
PLANTED = [
    ("api/routes/page.py", "from vlserve.model import loader", "The HTTP layer never reaches into the model"),
    ("api/routes/page.py", "import torch", "The HTTP layer never reaches into the model"),
    ("kernels/formats.py", "from vlserve.runtime import engine", "Each layer imports only the layers below it"),
    ("sizing/cpulist.py", "from vlserve import errors", "Each layer imports only the layers below it"),
    ("ops/units.py", "from vlserve.bench import workload", "Each layer imports only the layers below it"),
    ("sizing/common.py", "import pydantic", "The sizing engine and the audit run on a bare host"),
    ("runtime/images.py", "from vlserve.runtime import engine", "No import circle between the modules"),
]


@pytest.mark.parametrize(("module", "line", "contract"), PLANTED, ids=[f"{m}: {i}" for m, i, _ in PLANTED])
def test_a_planted_import_breaks_its_contract(tmp_path, module, line, contract):
    copy = tmp_path / "vlserve"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / module).open("a") as handle:
        handle.write("\n%s  # planted\n" % line)
    result = lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout
    assert "1 broken" in result.stdout, result.stdout  # this contract alone


def picture_rows() -> list[str]:
    """The layers as docs/architecture.md draws them, top first: the lines of its first code block."""
    block = ARCHITECTURE.read_text().split("```text\n", 1)[1].split("```", 1)[0]
    return [line.split("  ", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_picture_draws_the_layers_contract():
    (layers,) = [c for c in contracts() if c["type"] == "layers"]
    drawn = [" | ".join("vlserve." + part.strip() for part in row.split("|")) for row in picture_rows()]
    assert drawn == layers["layers"]
    text = ARCHITECTURE.read_text()
    for contract in contracts():  # every contract is explained under its id
        assert "`%s`" % contract["id"] in text, contract["id"]


def test_the_module_map_lists_every_module():
    on_disk = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*")
        if path.suffix in (".py", ".cpp", ".h") and path.name != "__init__.py" and "__pycache__" not in path.parts
    }
    listed = set(re.findall(r"^\| `([\w/]+\.(?:py|cpp|h))` \|", ARCHITECTURE.read_text(), re.M))
    assert listed == on_disk, {"not listed": sorted(on_disk - listed), "gone": sorted(listed - on_disk)}


def too_long(package: pathlib.Path) -> list[str]:
    """Modules over MAX_MODULE_LINES and functions over MAX_FUNCTION_LINES below `package`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(package).as_posix()
        if text.count("\n") > MAX_MODULE_LINES:
            found.append("%s: %d lines" % (name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append("%s: %s() %d lines" % (name, node.name, lines))
    return found


def test_no_module_or_function_is_too_long():
    assert not too_long(PACKAGE)


def test_the_size_check_finds_a_long_function_and_a_long_module(tmp_path):
    body = "\n".join("    x = %d" % i for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "short.py").write_text("def fine():\n    return 1\n")
    (tmp_path / "long.py").write_text("def long():\n%s\n" % body + "\n" * MAX_MODULE_LINES)
    assert too_long(tmp_path) == [
        "long.py: %d lines" % (MAX_FUNCTION_LINES + 1 + MAX_MODULE_LINES),
        "long.py: long() %d lines" % (MAX_FUNCTION_LINES + 1),
    ]


def transformers_imports(source: str) -> list[str]:
    """Where a module imports transformers (at its top or inside a function)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found += ["line %d: %s" % (node.lineno, name) for name in names if name.split(".")[0] == "transformers"]
    return found


def test_only_the_test_checkpoint_writer_imports_transformers():
    """The worker runs vlserve's own network and processor (model/network.py, model/processor.py);
    transformers writes test checkpoints (model/testmodel.py) and is what the tests hold them to."""
    importing = {
        path.relative_to(PACKAGE).as_posix(): transformers_imports(path.read_text()) for path in PACKAGE.rglob("*.py")
    }
    assert {name for name, found in importing.items() if found} == {"model/testmodel.py"}, importing


def test_the_import_scan_sees_each_kind_of_import():
    source = (
        "import transformers\n"
        "from transformers.models.qwen3_vl import modeling_qwen3_vl\n"
        "def f():\n"
        "    from transformers import AutoTokenizer\n"
        "import transformers_stream_generator\n"  # another package
        "from vlserve import transformers_like\n"
    )
    assert len(transformers_imports(source)) == 3
