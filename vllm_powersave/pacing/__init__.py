"""Decode pacing: space decode-only engine steps to a TPOT target so that batches grow.

See :mod:`.pacer` and docs/decode-pacing.md.
"""

from .pacer import ClosedLoopGuard, DecodePacer, PaceFacts, PaceFigures, PaceStats

__all__ = ["ClosedLoopGuard", "DecodePacer", "PaceFacts", "PaceFigures", "PaceStats"]
