"""The agent's HTTP endpoint: /metrics, /healthz and small read-only APIs.

Split by what changes together: ``routing`` (what each path answers, the server that binds
the port), ``serving`` (the event loop, its deadlines and caps), ``auth`` (basic auth and the
failed-login backoff). TLS, basic auth users and extra headers come from an exporter-toolkit
``web-config.yml`` (webconfig.py). The endpoint may face the network and every local user, so
every request and connection is bounded (the comment above ``serving.EventServer``).
"""

from __future__ import annotations

from profagent.exporters.http.routing import AgentHTTPServer, Route
from profagent.exporters.http.serving import HttpLimits
from profagent.exporters.webconfig import WebConfig, load_web_config

__all__ = ["AgentHTTPServer", "HttpLimits", "Route", "WebConfig", "load_web_config"]
