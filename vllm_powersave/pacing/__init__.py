"""Decode pacing: space decode-only engine steps to a TPOT target so that batches grow.

See :mod:`.pacer` and docs/decode-pacing.md.
"""

from .pacer import DecodePacer, PaceFacts, PaceFigures, PaceStats

__all__ = ["DecodePacer", "PaceFacts", "PaceFigures", "PaceStats"]
