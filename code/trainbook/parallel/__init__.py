"""Parallelism (Part 5 of the book): launching, and one module per technique.

Chapter: book/parallelism/collectives.
"""

from __future__ import annotations
