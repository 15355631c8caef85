"""Every file of the repository that the code, the docs or the README names exists."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEARCHED = ("keras_spatial", "recipes", "tools", "benchmarks", "docs", "examples", "tests")
TOP_LEVEL = ("README.md", "Makefile")
# A path inside the repository: one of its folders, then a file name with an extension.
REFERENCE = re.compile(r"\b((?:docs|tests|tools|benchmarks|examples|recipes|keras_spatial)/[\w./-]+\.(?:md|py|json|png|sh))")


def _searched_files():
    for name in TOP_LEVEL:
        yield os.path.join(ROOT, name)
    for folder in SEARCHED:
        for directory, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".md", ".sh")):
                    yield os.path.join(directory, name)


def test_every_named_file_exists():
    missing = {}
    for path in _searched_files():
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        for reference in set(REFERENCE.findall(text)):
            if not os.path.exists(os.path.join(ROOT, reference)):
                missing.setdefault(os.path.relpath(path, ROOT), []).append(reference)
    assert not missing, f"files named but not in the repository: {missing}"


def test_the_pattern_finds_references():
    assert REFERENCE.findall("see docs/design.md and `tests/unit/test_halo.py`.") == [
        "docs/design.md", "tests/unit/test_halo.py"]
