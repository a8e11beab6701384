"""The one error type the collector parsers raise.

Parsers in ``collectors.npu_smi`` and ``collectors.prometheus`` turn every kind of bad input
(empty, garbage, binary noise, a table cut mid-chip, a value that is not a number) into a
``ParseError`` with a one-line message that says what was expected and where; they never let
``IndexError``/``KeyError``/``ValueError`` from inside escape. ``ParseError`` subclasses
``ValueError`` so callers that already catch ``ValueError`` keep working.
"""

from __future__ import annotations


class ParseError(ValueError):
    """Input text is not a parsable npu-smi view or Prometheus exposition."""
