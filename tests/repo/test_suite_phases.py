"""tools/test.sh runs the suite in two phases: every test not marked `timing` in pytest-xdist
workers, then the `timing` tests alone, collecting only the files that `grep -l
'pytest.mark.timing'` finds. A `timing` test in a file the grep misses would run in
neither phase; this finds any (the marker in any spelling: `pytest.mark.timing`, a
`mark` imported on its own, `add_marker("timing")`, `getattr(pytest.mark, "timing")`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GREPPED = "pytest.mark.timing"  # the pattern tools/test.sh greps for


def marks_timing(source: str) -> bool:
    """Whether a module's code refers to the `timing` marker in any spelling."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "timing":
            base = node.value
            if (isinstance(base, ast.Attribute) and base.attr == "mark") or (
                    isinstance(base, ast.Name) and base.id == "mark"):
                return True
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "timing" for a in node.args):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("add_marker", "getattr", "Mark", "MarkDecorator"):
                return True
    return False


def test_the_grep_of_tools_test_sh_is_in_the_script():
    assert f"'{GREPPED}'" in (ROOT / "tools" / "test.sh").read_text()


def test_every_file_with_a_timing_test_is_found_by_the_grep():
    missed = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        source = path.read_text()
        if marks_timing(source) and (GREPPED not in source or not path.name.startswith("test_")):
            missed.append(str(path.relative_to(ROOT)))
    assert missed == [], f"timing tests tools/test.sh would not run: {missed}"


def test_the_check_sees_each_spelling():
    assert marks_timing("import pytest\n@pytest.mark.timing\ndef test_a(): pass\n")
    assert marks_timing("from pytest import mark\n@mark.timing\ndef test_a(): pass\n")
    assert marks_timing("def hook(item):\n    item.add_marker('timing')\n")
    assert marks_timing("import pytest\npytestmark = getattr(pytest.mark, 'timing')\n")
    assert not marks_timing("import pytest\n@pytest.mark.slow\ndef test_timing(): pass\n")
