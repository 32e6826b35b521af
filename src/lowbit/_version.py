"""lowbit's version, in a module of its own so the lowest layers can read it without importing the package."""

__version__ = "0.1.0"
