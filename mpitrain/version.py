"""The package's version, in a module of its own: the CLI, the trainer's setup agreement and
pyproject.toml read it without importing the package's API."""

__version__ = "0.1.0"
