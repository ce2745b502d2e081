"""What the real job reads, made offline: a Qwen2.5-VL processor directory and a small tagged
conversation corpus with generated images.

- The processor directory is what ``model_name_or_path`` names in MindSpeed-MM's data JSON:
  a byte-level BPE trained here with ``tokenizers`` on the corpus text, with Qwen2's
  pre-tokenizer regex and NFC normaliser, its vocabulary padded so that Qwen's special tokens
  sit at their real ids (151643-151656; MindSpeed-MM hard-codes 151655 ``<|image_pad|>`` and
  151652/151653 vision start/end), saved both as ``tokenizer.json`` (fast) and
  ``vocab.json`` + ``merges.txt`` (slow ``Qwen2Tokenizer``), a ``tokenizer_config.json`` with
  Qwen's chat template, and a ``preprocessor_config.json`` for ``Qwen2VLImageProcessor``
  with small min/max pixels.  ``AutoProcessor`` builds a real ``Qwen2_5_VLProcessor`` from it.
- Every sample's user turn starts with its tag ``sample-NNNN``; :func:`tags_in` reads the
  tags back from decoded token ids, so a test can tell which samples a step fed.

Nothing is fetched.  The same arguments give byte-identical files.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

# Qwen2 / Qwen2.5-VL special tokens at their real ids.
SPECIAL_TOKENS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>",
    151649: "<|box_end|>", 151650: "<|quad_start|>", 151651: "<|quad_end|>",
    151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>",
}
FIRST_SPECIAL = min(SPECIAL_TOKENS)
IMAGE_PAD_ID = 151655
# Qwen2's pre-tokenizer split (as in Qwen2Tokenizer / Qwen2TokenizerFast).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Image sides in pixels (multiples of 28 = patch 14 x merge 2); with MAX_PIXELS each image is
# 4-16 image tokens after the 2x2 merge.
SIDES = (56, 84, 112)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
TAG = re.compile(r"sample-(\d{4})")
WORDS = ("red", "green", "blue", "square", "circle", "shape", "left", "right", "top", "bottom", "small",
         "large", "colour", "image", "the", "a", "is", "in", "on", "of", "and", "with", "near", "corner",
         "centre", "bright", "dark", "picture", "shows", "there", "one", "two", "three", "what", "where")


def tag(index: int) -> str:
    return f"sample-{index:04d}"


def tags_in(text: str) -> list[int]:
    """The sample tags in decoded text, in order."""
    return [int(m) for m in TAG.findall(text)]


def _record(index: int, rng: random.Random) -> tuple[dict, tuple[int, int, tuple[int, int, int]]]:
    width, height = rng.choice(SIDES), rng.choice(SIDES)
    colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    record = {
        "messages": [
            {"role": "user", "content": f"<image>{tag(index)} {question}?"},
            {"role": "assistant", "content": f"{answer}."},
        ],
        "images": [f"images/{index:04d}.png"],
    }
    return record, (width, height, colour)


def make_corpus(root: Path, samples: int, seed: int = 0, first: int = 0) -> Path:
    """``samples`` one-image conversations tagged ``first`` ... in ``root/data.json`` (a JSON
    list, MindSpeed-MM's ``mllm_format`` layout), their PNGs in ``root/images``; returns the
    JSON path."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(first, first + samples):
        record, (width, height, colour) = _record(index, rng)
        image = Image.new("RGB", (width, height), colour)
        draw = ImageDraw.Draw(image)
        x, y = rng.randrange(width // 2), rng.randrange(height // 2)
        draw.rectangle([x, y, x + width // 3, y + height // 3], fill=tuple(255 - c for c in colour))
        image.save(root / record["images"][0])
        records.append(record)
    path = root / "data.json"
    path.write_text(json.dumps(records, indent=1))
    return path


def _corpus_text() -> list[str]:
    """Text the tokenizer is trained on: the words, the tags, the template's strings."""
    lines = [" ".join(WORDS), "You are a helpful assistant.", "system user assistant ?.\n"]
    lines += [tag(i) for i in range(2000)]
    return lines * 3


def make_processor(root: Path) -> Path:
    """A local Qwen2.5-VL processor directory (``AutoProcessor.from_pretrained(root)``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    root.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus_text(), trainer=trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    # Unreachable filler entries (no merge produces them) up to Qwen's first special id.
    for i in range(len(vocab), FIRST_SPECIAL):
        vocab[f"\u0100\u0100filler{i}"] = i
    data["model"]["vocab"] = vocab
    data["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for i, t in SPECIAL_TOKENS.items()]
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False}
    (root / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (root / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    merges = data["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (root / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "processor_class": "Qwen2_5_VLProcessor",
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
                                 for i, t in SPECIAL_TOKENS.items()},
        "additional_special_tokens": [t for i, t in SPECIAL_TOKENS.items() if i >= 151644],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": 131072,
        "split_special_tokens": False, "padding_side": "right", "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (root / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (root / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3,
    }, indent=1))
    (root / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }, indent=1))
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "architectures":
                                                  ["Qwen2_5_VLForConditionalGeneration"]}))
    return root
