"""A MindSpeed-MM conversation record -> token ids and labels (the ``qwen2vl`` and
``qwen3_vl_nothink`` chat templates, :data:`TEMPLATE_SYSTEMS`).

``<|im_start|>system\\n{system}<|im_end|>\\n`` (when the record or the default has one),
then per turn ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.  Only assistant contents
and their closing ``<|im_end|>\\n`` are trained; everything else gets label -100.  Each
``<image>`` in a content becomes ``<|vision_start|>`` + ``n`` image tokens +
``<|vision_end|>``, ``n`` being that image's LLM token count.

The two templates have the same turn slots and differ only in the system turn a record
without one gets: ``qwen2vl`` adds ``"You are a helpful assistant."``, ``qwen3_vl_nothink``
none.  Training on the other one's text would be silently wrong (every sample some tokens
longer or shorter than upstream's), so the job's template name picks it
(:func:`template_system`) and a template whose text is not reproduced here is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

from .errors import BadConversation, UnsupportedTemplate
from .tokenizer import TextTokenizer

IGNORE = -100
IMAGE_PLACEHOLDER = "<image>"
DEFAULT_SYSTEM = "You are a helpful assistant."
DEFAULT_TEMPLATE = "qwen2vl"  # when the job names none
# MindSpeed-MM chat template name -> the system turn it adds to a record without one.
# ``qwen3_vl`` (thinking: a ReasoningTemplate adding thought words) is not reproduced.
TEMPLATE_SYSTEMS: dict[str, str | None] = {"qwen2vl": DEFAULT_SYSTEM, "qwen3_vl_nothink": None}


def template_system(template: str, where: str = "template") -> str | None:
    """The default system turn of MindSpeed-MM's chat template ``template``;
    :class:`UnsupportedTemplate` naming ``where`` (the setting that named it) and the
    supported names when this module does not produce that template's text."""
    if template not in TEMPLATE_SYSTEMS:
        raise UnsupportedTemplate(f"{where}: {template!r} is not a chat template the packing loader reproduces; "
                                  f"supported: {sorted(TEMPLATE_SYSTEMS)}")
    return TEMPLATE_SYSTEMS[template]


def placeholder_count(record: dict[str, Any]) -> int:
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in _messages(record))


def check_conversation(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of ``record``; :class:`BadConversation` (kind ``empty_conversation``)
    when there is nothing to train on: no messages, a message that is not a role/content
    object, a ``system`` that is not a string, or no assistant turn with content."""
    raw = record.get("messages")
    if raw is not None and not isinstance(raw, list):
        raise BadConversation("empty_conversation", f"'messages' must be a list of turns, got {type(raw).__name__} "
                                                    f"{_short(raw)}")
    messages = _messages(record)
    if not messages:
        raise BadConversation("empty_conversation", "no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadConversation("empty_conversation", f"message {i} is not a {{'role': str, 'content': str}} object")
    if record.get("system") is not None and not isinstance(record["system"], str):
        raise BadConversation("empty_conversation", f"'system' must be a string, got {record['system']!r}")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise BadConversation("empty_conversation", "no assistant turn with content")
    return messages


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _messages(record: dict[str, Any]) -> list[Any]:
    messages = record.get("messages")
    return messages if isinstance(messages, list) else []


def tokenize_conversation(messages: Sequence[dict[str, Any]], image_token_counts: Sequence[int],
                          tokenizer: TextTokenizer, system: str | None = DEFAULT_SYSTEM) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)``; ``image_token_counts[k]`` tokens for the ``k``-th ``<image>``."""
    sp = tokenizer.special
    ids: list[int] = []
    labels: list[int] = []
    newline = tokenizer.encode("\n")
    images = iter(image_token_counts)

    def add(tokens: list[int], trained: bool) -> None:
        ids.extend(tokens)
        labels.extend(tokens if trained else [IGNORE] * len(tokens))

    def content(text: str, trained: bool) -> None:
        pieces = text.split(IMAGE_PLACEHOLDER)
        for k, piece in enumerate(pieces):
            if k:
                add([sp.vision_start] + [sp.image_pad] * next(images) + [sp.vision_end], trained)
            if piece:
                add(tokenizer.encode(piece), trained)

    turns = list(messages)
    if turns[0]["role"] == "system":
        system = turns.pop(0)["content"]
    if system:
        add([sp.im_start] + tokenizer.encode("system\n"), False)
        content(system, False)
        add([sp.im_end] + newline, False)
    for m in turns:
        trained = m["role"] == "assistant"
        add([sp.im_start] + tokenizer.encode(f"{m['role']}\n"), False)
        content(m["content"], trained)
        add([sp.im_end] + newline, trained)
    return ids, labels
