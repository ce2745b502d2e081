"""What the flow knows about a sample before the backbone sees it, and where its tensors live.

The encoder puts one pool entry per sample (its embeddings, with :class:`SampleMeta` as the
entry's metadata) and the backbone's scheduler groups ready samples from that metadata alone,
so the metadata is everything grouping needs: the sample's LLM token count (its sequence
length in the backbone, image tokens included), how many of those tokens are image tokens,
and the ViT patch count of each of its images (the encoder's cost).

:class:`SampleKey` is the one place that formats and parses the per-sample pool keys
``flow/step<n>/act/<sample id>`` (the embeddings) and ``flow/step<n>/grad/<sample id>`` (their
gradient, put back by the backbone for a trainable encoder).  The step is part of the key
because a frozen encoder may run ahead into later steps' samples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from ..schedule.keys import BoundaryKind
from .errors import SampleError

_KEY = re.compile(r"^flow/step(?P<step>\d+)/(?P<kind>act|grad)/(?P<sample>\d+)$")


@dataclass(frozen=True)
class SampleMeta:
    """One sample as the flow's schedulers see it.

    Attributes:
        sample_id: the sample's id, unique within the run (the loader's sample index).
        step: the training step the sample belongs to.
        llm_tokens: its sequence length in the backbone (text and image tokens).
        image_tokens: how many of those are image tokens (the encoder's output rows).
        patches: ViT patches of each of its images (empty for a text-only sample).
    """

    sample_id: int
    step: int
    llm_tokens: int
    image_tokens: int = 0
    patches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "patches", tuple(int(p) for p in self.patches))
        for name in ("sample_id", "step", "image_tokens"):
            if getattr(self, name) < 0:
                raise SampleError(f"sample {self.sample_id}: {name} must be >= 0, got {getattr(self, name)}")
        if self.llm_tokens < 1:
            raise SampleError(f"sample {self.sample_id}: llm_tokens must be >= 1, got {self.llm_tokens}")
        if self.image_tokens > self.llm_tokens:
            raise SampleError(f"sample {self.sample_id}: {self.image_tokens} image tokens in a sequence of "
                              f"{self.llm_tokens} tokens")
        if any(p < 1 for p in self.patches):
            raise SampleError(f"sample {self.sample_id}: every image needs >= 1 patch, got {list(self.patches)}")

    def key(self, kind: BoundaryKind | str) -> "SampleKey":
        """This sample's pool key for its embeddings (``"act"``) or their gradient (``"grad"``)."""
        return SampleKey(self.step, BoundaryKind(kind), self.sample_id)

    def to_pool_meta(self) -> dict[str, Any]:
        """The metadata of the sample's pool entry (JSON: lists, str keys)."""
        return {"sample_id": self.sample_id, "step": self.step, "llm_tokens": self.llm_tokens,
                "image_tokens": self.image_tokens, "patches": list(self.patches)}

    @classmethod
    def from_pool_meta(cls, meta: Mapping[str, Any]) -> "SampleMeta":
        """Read :meth:`to_pool_meta` back (from a pool entry's metadata)."""
        try:
            return cls(int(meta["sample_id"]), int(meta["step"]), int(meta["llm_tokens"]),
                       int(meta["image_tokens"]), tuple(meta["patches"]))
        except KeyError as missing:
            raise SampleError(f"pool metadata {dict(meta)!r} has no {missing} field") from None


class SampleKey(NamedTuple):
    """``flow/step<step>/<kind>/<sample_id>``: one sample's entry in the pool."""

    step: int
    kind: BoundaryKind
    sample_id: int

    def __str__(self) -> str:
        return f"flow/step{self.step}/{BoundaryKind(self.kind).value}/{self.sample_id}"

    @classmethod
    def parse(cls, text: str) -> "SampleKey":
        """Read ``"flow/step3/act/17"``; raises :class:`.SampleError` naming the text."""
        match = _KEY.match(str(text))
        if not match:
            raise SampleError(f"pool key {text!r}: expected `flow/step<n>/act|grad/<sample id>`")
        return cls(int(match["step"]), BoundaryKind(match["kind"]), int(match["sample"]))
