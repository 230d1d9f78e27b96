"""The shipped corpus (Tiny Shakespeare, public domain), read by trainbook.data with a checksum.

Chapter: book/start/first-run.
"""

from __future__ import annotations
