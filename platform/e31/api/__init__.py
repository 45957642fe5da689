"""The HTTP API: `create_app(settings)`."""

from e31.api.app import create_app

__all__ = ["create_app"]
