"""trainbook: the package behind the executable LLM training handbook."""

__version__ = "0.1.0"
