"""The release: one wheel, the same bytes for one commit, every command working from it outside the checkout."""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.machinery import SourceFileLoader

import pytest

from conftest import REPO, TOPOLOGIES
from vlserve.cli import BARE_GROUPS, SERVICE_GROUPS, build_parser

RELEASE = REPO / "scripts" / "release"


def _release_module():
    loader = SourceFileLoader("vlserve_release_script", str(RELEASE))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def release(*args: str, repo: pathlib.Path = REPO) -> dict:
    result = subprocess.run(
        [sys.executable, str(repo / "scripts" / "release"), *args], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> dict:
    return release("--out", str(tmp_path_factory.mktemp("release")))


def test_two_builds_of_one_checkout_are_the_same_bytes(wheel, tmp_path):
    again = release("--out", str(tmp_path))  # another directory: built anew, not taken from a cache
    assert again["sha256"] == wheel["sha256"] == hashlib.sha256(pathlib.Path(again["path"]).read_bytes()).hexdigest()
    assert again["version"] == wheel["version"]


def test_the_version_names_the_last_commit_that_changed_what_ships(wheel):
    last = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%H", "--", *_release_module().INPUTS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    base = tomllib.loads((REPO / "service" / "pyproject.toml").read_text())["project"]["version"]
    assert re.fullmatch(re.escape("%s+g%s" % (base, last[:12])) + r"(\.dirty\.[0-9a-f]{12})?", wheel["version"])


def test_a_commit_outside_what_ships_builds_the_same_wheel_and_one_inside_a_new_one(tmp_path):
    """So a change to the docs or the tests rolls no host, and a change to the code names its commit."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    for name in _release_module().INPUTS:  # this checkout's inputs as they are, committed in the clone
        source = REPO / name
        if (clone / name).is_dir():
            shutil.rmtree(clone / name)
        if source.is_dir():
            shutil.copytree(
                source,
                clone / name,
                symlinks=True,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
            )
        else:
            shutil.copy2(source, clone / name)
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-a", "-m"]
    subprocess.run(["git", "-C", str(clone), "add", "-A"], check=True)
    subprocess.run([*git[:-1], "--allow-empty", "-m", "this checkout"], check=True)  # a clean checkout: nothing differs
    first = release("--out", str(tmp_path / "a"), repo=clone)
    (clone / "README.md").write_text((clone / "README.md").read_text() + "\nmore docs\n")
    subprocess.run([*git, "docs"], check=True)
    assert release("--out", str(tmp_path / "b"), repo=clone)["sha256"] == first["sha256"]
    errors = clone / "service" / "vlserve" / "errors.py"
    errors.write_text(errors.read_text() + "\n# changed\n")
    dirty = release("--out", str(tmp_path / "c"), repo=clone)
    assert dirty["version"].startswith(first["version"] + ".dirty.")
    subprocess.run([*git, "code"], check=True)
    head = subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout
    committed = release("--out", str(tmp_path / "d"), repo=clone)
    assert committed["version"].endswith("+g" + head[:12]) and committed["sha256"] != first["sha256"]


def test_the_wheel_holds_every_module_and_data_file_the_commands_read(wheel):
    names = set(zipfile.ZipFile(wheel["path"]).namelist())
    package = REPO / "service" / "vlserve"
    wanted = {p.relative_to(package.parent).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    for pattern in ("schemas/*.json", "static/*", "kernels/*.cpp", "kernels/*.h", "data/*.yml"):
        wanted |= {p.relative_to(package.parent).as_posix() for p in package.glob(pattern)}
    wanted |= {"vlserve/data/templates/" + p.name for p in (REPO / "templates").iterdir()}
    assert wanted <= names, sorted(wanted - names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level names of every absolute import in the package, outside the standard library."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "service" / "vlserve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "vlserve":
                    found.setdefault(top, []).append(path.name)
    return found


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_import_in_the_package_is_a_declared_dependency():
    project = tomllib.loads((REPO / "service" / "pyproject.toml").read_text())["project"]
    declared = {
        _normalized(re.match(r"[A-Za-z0-9_.-]+", spec).group(0))
        for spec in project["dependencies"] + [s for extra in project["optional-dependencies"].values() for s in extra]
    }
    providers = importlib.metadata.packages_distributions()
    # audit.py runs inside Ansible's module runtime, which provides `ansible` itself.
    imported = {name: where for name, where in _third_party_imports().items() if name != "ansible"}
    undeclared = {
        name: where
        for name, where in imported.items()
        if not {_normalized(d) for d in providers.get(name, [name])} & declared
    }
    assert not undeclared, "imported but not declared in service/pyproject.toml: %s" % undeclared


def test_describing_something_that_is_not_a_wheel_fails_in_one_line(tmp_path):
    bogus = tmp_path / "vlserve-1-py3-none-any.whl"
    bogus.write_bytes(b"not a zip")
    result = subprocess.run(
        [sys.executable, str(RELEASE), "--describe", str(bogus)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(bogus) in result.stderr


def test_keep_removes_only_the_oldest_other_builds(tmp_path):
    module = _release_module()
    for age in range(4):
        (tmp_path / ("w%d.whl" % age)).write_bytes(b"w")
        described = tmp_path / ("vlserve-%016d.json" % age)
        described.write_text(json.dumps({"wheel": "w%d.whl" % age}))
        os.utime(described, (1e9 - age, 1e9 - age))
    (tmp_path / "notes.txt").write_text("not a build")
    module.prune(tmp_path, 1, current="w3.whl")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt",
        "vlserve-0000000000000000.json",
        "vlserve-0000000000000003.json",
        "w0.whl",
        "w3.whl",
    ]


def _listed_commands(venv: pathlib.Path, cwd: pathlib.Path) -> set[str]:
    result = _run(venv, cwd, "--help")
    block = result.stdout.split("COMMAND\n", 1)[1].split("\noptions:", 1)[0]
    return {line.split()[0] for line in block.splitlines() if re.match(r"^    \S", line)}


def _run(venv: pathlib.Path, cwd: pathlib.Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = "%s:/usr/bin:/bin" % (venv / "bin")
    result = subprocess.run(
        [str(venv / "bin" / "vlserve"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, "vlserve %s: %s" % (" ".join(args), result.stderr[-3000:])
    return result


def _handler_module(parser) -> str:
    """The module of a command's handler (of its first action's, for a command with actions)."""
    if parser.get_default("handler") is not None:
        return parser.get_default("handler").__module__
    (actions,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return _handler_module(next(iter(actions.choices.values())))


def _commands_of(groups) -> set[str]:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    return {name for name, sub in commands.choices.items() if _handler_module(sub) in {g.__name__ for g in groups}}


def _fresh_venv(path: pathlib.Path, *install: str) -> pathlib.Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *install], check=True, timeout=1800)
    return path


def test_the_bare_wheel_lists_and_runs_only_what_needs_no_service_stack(wheel, tmp_path):
    """A controller without torch: the planner and the renderers, from the wheel's own templates."""
    venv = _fresh_venv(tmp_path / "venv", wheel["path"])
    assert _listed_commands(venv, tmp_path) == _commands_of(BARE_GROUPS)
    facts = str(TOPOLOGIES / "xeon-avx512bf16-2vcpu-vm.json")
    _run(venv, tmp_path, "plan", "--facts", facts)
    _run(
        venv, tmp_path, "render-units", "--out", str(tmp_path / "units"), "--facts", facts, "--front-bind", "127.0.0.1"
    )
    assert (tmp_path / "units" / "etc" / "systemd" / "system" / "vlserve@.service").is_file()


@pytest.mark.slow
def test_every_command_runs_from_the_installed_wheel_outside_the_checkout(wheel, torch_wheel, tmp_path):
    venv = _fresh_venv(
        tmp_path / "venv", torch_wheel, wheel["path"] + "[serve]", "-c", str(REPO / "service" / "requirements.txt")
    )
    listed = _listed_commands(venv, tmp_path)
    assert listed == _commands_of(BARE_GROUPS + SERVICE_GROUPS)
    for command in sorted(listed):
        _run(venv, tmp_path, command, "--help")
    assert _run(venv, tmp_path, "--version").stdout.strip() == "vlserve " + wheel["version"]
    model = tmp_path / "tiny"
    _run(venv, tmp_path, "make-test-model", str(model))
    _run(
        venv,
        tmp_path,
        "quant-check",
        "--model",
        str(model),
        "--prompts",
        "1",
        "--answer-tokens",
        "4",
        "--output",
        str(tmp_path / "q.json"),
    )
    assert set(json.loads((tmp_path / "q.json").read_text())["levels"]) == {"int8", "int4"}
    _run(
        venv,
        tmp_path,
        "bench-decode",
        "--model",
        str(model),
        "--levels",
        "none",
        "int8",
        "--tokens",
        "2",
        "--rounds",
        "1",
        "--prompt-tokens",
        "8",
        "--output",
        str(tmp_path / "d.json"),
    )
    assert json.loads((tmp_path / "d.json").read_text())
    facts = str(TOPOLOGIES / "xeon-avx512bf16-2vcpu-vm.json")
    _run(
        venv, tmp_path, "render-units", "--out", str(tmp_path / "units"), "--facts", facts, "--front-bind", "127.0.0.1"
    )
