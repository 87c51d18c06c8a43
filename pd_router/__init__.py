"""pd-router: one OpenAI-compatible endpoint in front of prefill and decode engines."""

__version__ = "0.1.0"
