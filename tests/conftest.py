"""Every test plans from fresh captures: the disk cache (``autopar.cache``) is off unless a test
turns it on for itself (a developer's warm cache must not hide a capture bug); processes the
tests start inherit it."""

from __future__ import annotations

import os

os.environ["AUTOPAR_CACHE"] = "off"
