"""Grafana dashboards as code, their provisioning files, and ``profagent dashboards``.

The dashboards are generated from Python with Grafana's ``grafana-foundation-sdk``
(``generate``), and the result is committed under ``dashboards/``. The installed package
never needs the SDK: ``export`` and ``push`` work from the committed files, found with
``profagent.assets.asset_dir("dashboards")``.
"""
