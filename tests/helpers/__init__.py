"""Plain helpers shared by the tests (the pytest fixtures are in tests/conftest.py).

paths: the checkout, the workloads and the shared fixtures folder; processes: waiting,
killing process trees, py-spy children; agent: a real `profagent` subprocess and its
/metrics; prometheus: a real Prometheus and promtool; watch: fake jobs for watch mode.
"""
