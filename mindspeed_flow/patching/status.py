"""What the registry and ``doctor`` say about one patch, and the error raised when a target
does not fit."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PatchConflictError, PatchError

# Status words, shared by the registry's report and doctor.
DECLARED = "declared"  # feature not enabled: nothing done
PENDING = "pending"  # enabled; applied when the target module is imported
APPLIED = "applied"
SKIPPED = "skipped"  # optional patch whose target is missing or changed
FOUND = "found"  # doctor: target present with a compatible signature
MISSING = "missing"  # target module present, attribute absent
SIGNATURE_CHANGED = "signature changed"
NOT_INSTALLED = "not installed"  # the upstream package itself is absent

FAILING = (MISSING, SIGNATURE_CHANGED)


@dataclass(frozen=True)
class PatchStatus:
    feature: str
    target: str
    status: str
    detail: str = ""
    version: str = ""
    optional: bool = False

    @property
    def is_failure(self) -> bool:
        """A required target that is missing or changed: doctor exits non-zero on it."""
        return self.status in FAILING and not self.optional


def format_table(rows: list[PatchStatus]) -> str:
    """Fixed-width table, one line per patch, for the terminal."""
    header = ("feature", "target", "status", "upstream", "detail")
    cells = [header] + [
        (r.feature + (" (optional)" if r.optional else ""), r.target, r.status, r.version, r.detail)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header) - 1)]
    lines = []
    for c in cells:
        head = "  ".join(text.ljust(w) for text, w in zip(c[:-1], widths))
        lines.append((head + "  " + c[-1]).rstrip())
    return "\n".join(lines)
