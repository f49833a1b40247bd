"""Grafana provisioning files: the Prometheus datasource and the dashboards provider.

No grafana-foundation-sdk here: ``profagent dashboards export`` uses this module at run time.
"""

from __future__ import annotations

# The datasource the provisioning file creates; the dashboards default to it.
DATASOURCE_UID = "profagent-prometheus"
DATASOURCE_NAME = "profagent Prometheus"
FOLDER = "profagent"
# Where the provider reads the dashboards inside Grafana (deploy/docker-compose.yml
# mounts dashboards/ there); `profagent dashboards export --grafana-path` changes it.
DEFAULT_DASHBOARDS_PATH = "/var/lib/grafana/dashboards/profagent"
DATASOURCE_FILE = "provisioning/datasources/profagent.yaml"
PROVIDER_FILE = "provisioning/dashboards/profagent.yaml"


def datasource_yaml() -> str:
    """The Prometheus datasource, with a fixed uid; its URL comes from $PROMETHEUS_URL."""
    return f"""\
# Grafana datasource provisioning for profagent's dashboards (generated: profagent dashboards).
# Grafana expands $PROMETHEUS_URL from its own environment, e.g. PROMETHEUS_URL=http://prometheus:9090
apiVersion: 1

datasources:
  - name: {DATASOURCE_NAME}
    uid: {DATASOURCE_UID}
    type: prometheus
    access: proxy
    url: ${{PROMETHEUS_URL}}
    isDefault: false
    editable: true
    jsonData:
      httpMethod: POST
      timeInterval: 15s
"""


def provider_yaml(path: str = DEFAULT_DASHBOARDS_PATH) -> str:
    """The file provider that loads the dashboards' JSON into the "profagent" folder."""
    return f"""\
# Grafana dashboard provisioning for profagent (generated: profagent dashboards).
apiVersion: 1

providers:
  - name: profagent
    orgId: 1
    folder: {FOLDER}
    folderUid: {FOLDER}
    type: file
    disableDeletion: false
    allowUiUpdates: false
    updateIntervalSeconds: 60
    options:
      path: {path}
      foldersFromFilesStructure: false
"""
