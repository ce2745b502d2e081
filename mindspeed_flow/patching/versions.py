"""The upstream versions the patches were checked against: the labels of ``Patch.checked``.

Written once here so that every patch names a version the same way (``doctor`` prints the
labels, a signature mismatch quotes them) and a new upstream pin is one edit.  Megatron-LM
is named by its git tag, ``core_v0.12.1`` (MindSpeed-MM's install copies ``megatron/`` from
that tag; ``core_r0.12.1`` is the name of MindSpeed's release branches, not a Megatron-LM
tag); MindSpeed and MindSpeed-MM by the commits the upstream tests unpack
(``../shared/UPSTREAM.md``).
"""

from __future__ import annotations

MEGATRON_CORE = "megatron-core 0.12.3"  # the wheel of the main suite, on MindSpeed-MM's 0.12 line
MEGATRON_CORE_NEXT = "megatron-core 0.16.1"  # the newer wheel the adapters also support
MEGATRON_LM = "Megatron-LM core_v0.12.1"  # the source tree MindSpeed-MM pins
MINDSPEED = "MindSpeed 028de58"
MINDSPEED_MM = "MindSpeed-MM 57069cd"


def source(label: str) -> str:
    """``label`` where the patch was checked against that version's source tree."""
    return f"{label} (source)"
