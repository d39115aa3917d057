"""What the record scripts share at their command line."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path


def one_line_errors(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A record script's ``main`` that ends a raw input which is missing, cut short or of another
    shape with one line (exit 2) instead of a traceback; nothing is written then."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except json.JSONDecodeError as e:
            why = f"not JSON, or cut short ({e})"
        except KeyError as e:
            why = f"no field {e} where the record needs one"
        except (OSError, ValueError, TypeError, IndexError, AttributeError, ArithmeticError) as e:
            why = f"{type(e).__name__}: {e}"
        script = Path(getattr(sys.modules.get(main.__module__), "__file__", None) or main.__module__).stem
        print(f"error: {script}: the raw input cannot be read: {why}; nothing written", file=sys.stderr)
        return 2

    return run
