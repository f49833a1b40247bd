"""One truncation and one top-K + "other" fold for every free-form label."""

from __future__ import annotations

from profagent.labels import LABEL_MAX, OTHER, fold_top_k, shorten


def test_shorten_keeps_what_fits_and_marks_what_it_cut() -> None:
    assert shorten("x" * LABEL_MAX) == "x" * LABEL_MAX
    cut = shorten("x" * (LABEL_MAX + 1))
    assert len(cut) == LABEL_MAX and cut.endswith("…")
    assert shorten("abcdef", 4) == "abc…"


def test_fold_keeps_k_names_merges_equal_shortened_names_and_sums_the_rest() -> None:
    rows = [("a" * 10 + "1", 5.0), ("a" * 10 + "2", 4.0), ("b", 3.0), ("c", 2.0), (OTHER, 1.0)]
    assert fold_top_k(rows, 3, limit=6) == {"aaaaa…": 9.0, "b": 3.0, OTHER: 3.0}
    assert fold_top_k([], 3) == {}


def test_bound_keeps_short_values_and_hashes_long_ones_distinctly() -> None:
    from profagent.labels import bound

    assert bound("4242") == "4242" and bound("é" * 64) == "é" * 64  # 128 bytes: fits
    a, b = bound("x" * 120_000 + "a"), bound("x" * 120_000 + "b")
    assert a != b and len(a.encode()) == len(b.encode()) == 128
    assert a.startswith("x" * 100) and "…" in a
    cut = bound("é" * 100)  # never half a character
    assert len(cut.encode()) <= 128 and cut.encode().decode() == cut and cut.startswith("é" * 50)
    assert len(bound("y" * 1000, limit=40).encode()) == 40
    assert len(bound("y" * 1000, limit=1).encode()) == 32  # VALUE_MIN


def test_environ_values_are_bounded_where_they_enter(tmp_path) -> None:
    from profagent.system.procfs import read_environ

    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "environ").write_bytes(b"SLURM_JOB_ID=" + b"9" * 200_000 + b"\0RANK=3\0")
    env = read_environ(tmp_path, 7)
    assert env["RANK"] == "3" and len(env["SLURM_JOB_ID"].encode()) == 128
