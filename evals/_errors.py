"""The house error type, imported in one place.

evals must not depend on the trainer, yet user-input errors must be the project's single
`ConfigError` (CLIs catch that one type). It currently lives in axonn.config; if it moves to a
dependency-free module, only this import changes.
"""
from axonn.config import ConfigError, fail

__all__ = ["ConfigError", "fail"]
