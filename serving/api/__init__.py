"""The OpenAI-compatible HTTP API over the engine and the adapter pool (FastAPI)."""

from serving.api.app import create_app

__all__ = ["create_app"]
