"""The agent: the target (what we watch), the runtime, the sources and their state."""
