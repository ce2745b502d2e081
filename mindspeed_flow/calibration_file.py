"""Reading one cost model's coefficients out of the JSON ``scripts/calibrate_cost_model.py``
writes, so every consumer (the trainer's ``data.llm_cost``, the flow's encoder cost) refuses
the same bad files the same way: the message names the file and the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def read_calibrated_terms(path: str | Path, key: str, known: Sequence[str], *, where: str,
                          error: type[Exception]) -> dict[str, Any]:
    """The ``key`` mapping of the calibration JSON at ``path`` (its terms by name).

    ``where`` prefixes every message (it should name the file); ``error`` is the caller's
    exception class.  A file that cannot be read, is not JSON, has no ``key`` mapping or a
    term not in ``known`` is refused; the values are the caller's to check."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise error(f"{where}: cannot read the calibrated cost model ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON: {exc}") from None
    terms = data.get(key) if isinstance(data, dict) else None
    if not isinstance(terms, dict):
        raise error(f"{where}: no '{key}' mapping (the JSON scripts/calibrate_cost_model.py writes has one)")
    unknown = sorted(set(terms) - set(known))
    if unknown:
        raise error(f"{where}: unknown term {key}.{unknown[0]} (known: {', '.join(known)})")
    return terms
