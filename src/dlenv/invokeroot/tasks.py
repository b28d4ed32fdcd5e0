"""dlenv's invoke tasks, for invoke's search root (see this package's docstring)."""

from dlenv.tasks import ns

__all__ = ["ns"]
