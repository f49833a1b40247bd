"""Incident bundles: when a job hangs or slows down, capture the evidence on every rank.

``trigger`` (IncidentsSource: when to capture), ``capture`` (one bundle's evidence),
``summary`` (its first page), ``bundle`` (file names and the typed ``incident.json``),
``store`` (the folder, retention, rate limits kept across restarts, reading for the API
and the CLI). A bundle is one 0700 folder under the agent's state folder, written with
O_NOFOLLOW|O_EXCL so a planted symlink is never followed; docs/incidents.md lists its files.
"""
