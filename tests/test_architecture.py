"""The package structure holds: layers (import-linter contracts in pyproject.toml), no reach-ins to
another package's private names, every package a real package, argparse only in the CLI, small files."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "afdserve"
MAX_LINES = 450


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path, path.relative_to(SRC).parts[0] if len(path.relative_to(SRC).parts) > 1 else None


def test_layer_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    out = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_no_import_of_another_packages_private_names():
    bad = []
    for path, pkg in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("afdserve"):
                parts = node.module.split(".")
                target = parts[1] if len(parts) > 1 else None
                names = [a.name for a in node.names]
                if target != pkg and (any(p.startswith("_") for p in parts[1:])
                                      or any(n.startswith("_") for n in names)):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {', '.join(names)}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == "afdserve" and any(p.startswith("_") for p in parts[1:]):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}")
    assert bad == []


def test_every_package_has_an_init_and_argparse_is_only_in_the_cli():
    for d in [p for p in SRC.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]:
        assert (d / "__init__.py").is_file(), f"{d.relative_to(ROOT)} has no __init__.py"
    users = [str(p.relative_to(ROOT)) for p, pkg in _modules() if pkg != "cli" and "argparse" in p.read_text()]
    assert users == []


def test_no_source_file_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p, _ in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_generic_layers_say_nothing_of_the_cpu_only_machinery():
    """Core lending lives behind the cpu backend's host hooks (``afdserve.backends.host``); the
    runtime, comm, cluster and engine packages neither import it nor speak of it, nor of the LM-head
    shares and claim words that are gone."""
    import re

    words = re.compile(r"\blen[dt]|\bborrow|claim word|core.board|lm.head.share|LMHeadShare", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p, pkg in _modules()
             if pkg in ("runtime", "comm", "cluster", "engine")
             for n, line in enumerate(p.read_text().splitlines(), 1) if words.search(line)]
    assert found == []


def test_only_the_backends_and_the_cli_reach_the_cpu_kernels():
    users = [str(p.relative_to(ROOT)) for p, pkg in _modules() if pkg not in ("backends", "cli")
             and re.search(r"afdserve\.backends\.cpu|afdserve\.backends import cpu|torch\.ops\.afdserve_kernels",
                           p.read_text())]
    assert users == []
