"""The layout the code promises (issue 52), read from the source's imports: the library packages
hold no benchmark code and import no benchmark, load test or test server; those live in
benchmarks/, spark_bench/ and testservers/, above the library."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("_native", "wal", "s3stream", "compaction", "pyspark_s3stream")
ABOVE = ("benchmarks", "spark_bench", "testservers")


def modules(package: str):
    """(dotted name, path) of every Python module of `package`."""
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join(parts), path


def imported(name: str, path: Path) -> set[str]:
    """The modules `path` (module `name`) imports, relative imports resolved, wherever the
    import statement is (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
    return out


def test_library_packages_hold_no_benchmark():
    found = [str(path.relative_to(ROOT)) for package in LIBRARY for name, path in modules(package)
             if path.name.startswith("bench") and name != "s3stream.cli.bench"]   # (the command that finds them)
    assert not found, f"benchmark modules inside the library: {found}; they belong in benchmarks/"


def test_library_packages_import_no_benchmark_load_test_or_test_server():
    wrong = []
    for package in LIBRARY:
        for name, path in modules(package):
            for target in imported(name, path):
                if target.split(".")[0] in ABOVE:
                    wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "\n".join(wrong)
