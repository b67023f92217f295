"""Node agents on localhost. The helpers live beside the tests; tests/ has no packages, so this
directory goes on the path once, here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
