"""Text side of decoding: one small interface over the tokenizers users pass.

Accepted: a Hugging Face ``PreTrainedTokenizer(Fast)``, a processor that carries one as
``.tokenizer`` (the Qwen2-VL processor from a model path), a ``tokenizers.Tokenizer``, a
path to a ``tokenizers`` JSON file, or ``None``: the small byte-level BPE that
``scripts/make_demo_data.py`` trains on the demo corpus and saves as
``flow_demo_tokenizer.json`` beside the shards.  Nothing is ever fetched.

The chat markers and vision tokens are looked up by their Qwen2-VL names; the demo
tokenizer declares the same names as special tokens (with its own ids).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>")


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int


class TextTokenizer:
    """``encode(text) -> list[int]`` without added special tokens, and the special ids."""

    def __init__(self, backend: Any, name: str) -> None:
        self.backend = backend
        self.name = name
        self.fast = _is_tokenizers(backend)
        ids = [self._token_id(tok) for tok in SPECIAL_TOKENS]
        missing = [tok for tok, i in zip(SPECIAL_TOKENS, ids) if i is None]
        if missing:
            raise ValueError(f"tokenizer {name}: no id for the special token(s) {missing}; a Qwen2-VL "
                             f"tokenizer or the demo tokenizer is needed")
        self.special = SpecialIds(*ids)

    def encode(self, text: str) -> list[int]:
        if self.fast:
            return self.backend.encode(text, add_special_tokens=False).ids
        return list(self.backend.encode(text, add_special_tokens=False))

    def _token_id(self, token: str) -> int | None:
        if self.fast:
            return self.backend.token_to_id(token)
        found = self.backend.convert_tokens_to_ids(token)
        # an unknown token maps to the unknown id, unless it is the unknown token itself
        # (Qwen2's tokenizer uses <|endoftext|> as its unk token)
        unknown = found == getattr(self.backend, "unk_token_id", None) and token != getattr(self.backend, "unk_token", None)
        return None if found is None or unknown else int(found)


def _is_tokenizers(obj: Any) -> bool:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return False
    return isinstance(obj, Tokenizer)


def load_tokenizer(tokenizer_or_processor: Any, corpus_root: str | os.PathLike) -> TextTokenizer:
    """Resolve what the user passed (see the module docstring)."""
    from tokenizers import Tokenizer

    obj = tokenizer_or_processor
    if obj is None:
        path = Path(corpus_root) / "flow_demo_tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer None means the demo tokenizer {path}, which does not exist: "
                                    f"run scripts/make_demo_data.py, or pass a tokenizer or processor")
        return TextTokenizer(Tokenizer.from_file(str(path)), str(path))
    if isinstance(obj, (str, os.PathLike)):
        return TextTokenizer(Tokenizer.from_file(str(obj)), str(obj))
    backend = getattr(obj, "tokenizer", None) or obj  # a processor carries its tokenizer
    return TextTokenizer(backend, type(backend).__name__)


def train_demo_tokenizer(texts: Iterable[str], path: str | os.PathLike, vocab_size: int = 2048) -> None:
    """Train a byte-level BPE on ``texts`` and save it as a ``tokenizers`` JSON file.

    Byte-level, so any text encodes without unknown tokens; the Qwen2-VL marker names are
    its special tokens.  Deterministic for the same texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
