"""The embedded core's parts: ``federation.agent.embedded_core.EmbeddedCore`` is the thin
class that satisfies ``LocalCore`` and asks each part in turn."""
