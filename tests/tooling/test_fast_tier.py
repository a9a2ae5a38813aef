"""The fast tier's list (`tests/fast_tier.py`) marks what it names and reports what it no longer
names, so `make test-fast` refuses a renamed case instead of silently running less."""

from types import SimpleNamespace

import fast_tier


class Item(SimpleNamespace):
    def add_marker(self, marker):
        self.markers.append(marker)


def test_entries_name_folders_tests_and_cases_and_unmatched_ones_are_reported(monkeypatch):
    monkeypatch.setattr(
        fast_tier,
        "FAST",
        {"unit/": "", "parity/test_a.py::test_b": "", "parity/test_a.py::test_c[x]": "", "gone/": ""},
    )
    monkeypatch.setattr(fast_tier, "SKIPPED", {"unit/test_slow.py": ""})
    ids = [
        "tests/unit/test_x.py::test_y",
        "tests/unit/test_slow.py::test_z",
        "tests/parity/test_a.py::test_b[1]",
        "tests/parity/test_a.py::test_bb",
        "tests/parity/test_a.py::test_c[x]",
        "tests/parity/test_a.py::test_c[y]",
    ]
    items = [Item(nodeid=i, markers=[]) for i in ids]
    assert fast_tier.mark(items, "fast") == ["gone/"]
    assert [i.nodeid for i in items if i.markers] == [ids[0], ids[2], ids[4]]
