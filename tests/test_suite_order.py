"""The suite's own scheduling (tests/conftest.py): the long files it sends to the workers first exist under these
names (a renamed file would silently start wherever it falls), and the sort puts their tests first, each file's
tests in their order."""

import types
from pathlib import Path

import conftest

TESTS = Path(conftest.__file__).resolve().parent


def test_the_long_files_exist():
    missing = [f for f in conftest.LONG_FIRST if not (TESTS / f).is_file()]
    assert not missing, f"tests/conftest.py LONG_FIRST names files that are not there: {missing}"
    assert len(set(conftest.LONG_FIRST)) == len(conftest.LONG_FIRST)


def test_long_files_sort_first_and_keep_each_files_order():
    def item(rel, name):
        return types.SimpleNamespace(path=TESTS / rel, name=name)
    first, second = conftest.LONG_FIRST[0], conftest.LONG_FIRST[1]
    items = [item("test_io.py", "a"), item(second, "b1"), item("test_io.py", "c"), item(first, "d1"),
             item(second, "b2"), item(first, "d2")]
    items.sort(key=conftest._long_first_rank)
    assert [i.name for i in items] == ["d1", "d2", "b1", "b2", "a", "c"]
    assert conftest._long_first_rank(types.SimpleNamespace(path=Path("/elsewhere/test_x.py"))) == len(conftest.LONG_FIRST)
