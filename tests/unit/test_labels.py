"""One truncation and one top-K + "other" fold for every free-form label."""

from __future__ import annotations

from profagent.analysis.labels import LABEL_MAX, OTHER, fold_top_k, shorten


def test_shorten_keeps_what_fits_and_marks_what_it_cut() -> None:
    assert shorten("x" * LABEL_MAX) == "x" * LABEL_MAX
    cut = shorten("x" * (LABEL_MAX + 1))
    assert len(cut) == LABEL_MAX and cut.endswith("…")
    assert shorten("abcdef", 4) == "abc…"


def test_fold_keeps_k_names_merges_equal_shortened_names_and_sums_the_rest() -> None:
    rows = [("a" * 10 + "1", 5.0), ("a" * 10 + "2", 4.0), ("b", 3.0), ("c", 2.0), (OTHER, 1.0)]
    assert fold_top_k(rows, 3, limit=6) == {"aaaaa…": 9.0, "b": 3.0, OTHER: 3.0}
    assert fold_top_k([], 3) == {}
