"""Exporters: how state becomes metrics (Prometheus) and dashboards (Grafana)."""
