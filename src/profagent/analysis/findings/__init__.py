"""Findings: answers computed from the latest state of every source (pure, no I/O).

A finding (``profagent.contracts.Finding``) says what is wrong with a job or one of its
ranks, how bad it is, and the evidence it rests on. The set of kinds is closed (the
``FindingKind`` literal, here ``FINDING_KINDS``) and documented in docs/diagnosis.md; each
analyzer is one module here, which declares its ``ANALYZERS`` and the kinds held over a
window (``WINDOW_HELD``), run by ``evaluate.py``.
"""

from __future__ import annotations

from typing import get_args

from profagent.contracts import FindingKind

FINDING_KINDS: tuple[FindingKind, ...] = get_args(FindingKind)
