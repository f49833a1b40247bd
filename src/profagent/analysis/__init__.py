"""Analyzers: pure functions over parsed data (traces, stack samples). No I/O here."""
