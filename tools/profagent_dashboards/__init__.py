"""Generator of the committed Grafana dashboards (development only; needs grafana-foundation-sdk)."""
