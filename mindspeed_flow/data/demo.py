"""A small deterministic multimodal corpus in MindSpeed-MM's format, for tests and the demo.

Images are drawn with Pillow (coloured circles, squares and triangles on a background,
sides from 40 to 448 pixels, so dynamic resolution gives many grid sizes); records are
captions, one- to three-turn Q/A about the picture, two-image comparisons and text-only
turns of varied length.  Shards: three JSON Lines files and one JSON list.  The demo
tokenizer (a byte-level BPE trained on the corpus text) is saved beside the shards as
``flow_demo_tokenizer.json``.  The same ``seed`` gives byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

from .source import DEMO_TOKENIZER_FILE
from .tokenizer import train_demo_tokenizer

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
          "purple": (140, 60, 170), "orange": (240, 140, 30), "black": (20, 20, 20), "white": (245, 245, 245)}
BACKGROUNDS = {"gray": (128, 128, 128), "beige": (225, 210, 180), "teal": (40, 130, 130), "navy": (20, 30, 80)}
SHAPES = ("circle", "square", "triangle")
FACTS = [
    "Red, green and blue are the primary colours of light.",
    "A triangle has three sides and its angles add up to one hundred and eighty degrees.",
    "A square is a rectangle whose four sides have the same length.",
    "The circumference of a circle is pi times its diameter.",
    "Mixing yellow and blue paint gives green.",
    "Orange is between red and yellow on the colour wheel.",
]


def _draw(rng: random.Random, path: Path) -> list[tuple[str, str]]:
    from PIL import Image, ImageDraw

    width, height = rng.randint(40, 448), rng.randint(40, 448)
    background = rng.choice(sorted(BACKGROUNDS))
    img = Image.new("RGB", (width, height), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    shapes = []
    for _ in range(rng.randint(1, 4)):
        shape, color = rng.choice(SHAPES), rng.choice(sorted(COLORS))
        size = rng.randint(8, max(9, min(width, height) // 2))
        x, y = rng.randint(0, max(0, width - size)), rng.randint(0, max(0, height - size))
        box = (x, y, x + size, y + size)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=COLORS[color])
        shapes.append((color, shape))
    img.save(path, format="PNG")
    return [("background", background)] + shapes


def _describe(content: list[tuple[str, str]]) -> str:
    background = content[0][1]
    things = ", ".join(f"a {c} {s}" for c, s in content[1:])
    return f"The picture shows {things} on a {background} background."


def _qa(rng: random.Random, content: list[tuple[str, str]]) -> tuple[str, str]:
    shapes = content[1:]
    kind = rng.randrange(3)
    if kind == 0:
        return "How many shapes are in the picture?", f"There {'is' if len(shapes) == 1 else 'are'} {len(shapes)} shape{'s' * (len(shapes) > 1)}."
    color, shape = rng.choice(shapes)
    if kind == 1:
        return f"What colour is the {shape}?", f"The {shape} is {color}."
    return "What is the background colour?", f"The background is {content[0][1]}."


def _records(rng: random.Random, image_dir: Path, count: int) -> Iterator[dict[str, Any]]:
    for i in range(count):
        kind = rng.choices(("caption", "qa", "two", "text"), weights=(4, 4, 1, 2))[0]
        if kind == "text":
            facts = rng.sample(FACTS, rng.randint(1, len(FACTS)))
            answer = " ".join(facts * rng.randint(1, 6))
            yield {"messages": [{"role": "user", "content": "Tell me something about shapes and colours."},
                                {"role": "assistant", "content": answer}], "images": []}
            continue
        names = [f"images/{i:05d}_{k}.png" for k in range(2 if kind == "two" else 1)]
        contents = [_draw(rng, image_dir.parent / n) for n in names]
        if kind == "caption":
            messages = [{"role": "user", "content": "<image>\nDescribe the picture."},
                        {"role": "assistant", "content": _describe(contents[0])}]
        elif kind == "two":
            a, b = len(contents[0]) - 1, len(contents[1]) - 1
            answer = "They have the same number of shapes." if a == b else \
                f"The {'first' if a > b else 'second'} picture has more shapes ({max(a, b)} against {min(a, b)})."
            messages = [{"role": "user", "content": "<image>\n<image>\nWhich picture has more shapes?"},
                        {"role": "assistant", "content": answer}]
        else:
            messages = []
            for turn in range(rng.randint(1, 3)):
                question, answer = _qa(rng, contents[0])
                messages += [{"role": "user", "content": ("<image>\n" if turn == 0 else "") + question},
                             {"role": "assistant", "content": answer}]
        yield {"messages": messages, "images": names}


def make_demo_corpus(out_dir: str | Path, samples: int = 400, seed: int = 0, shards: int = 4) -> Path:
    """Write the corpus (``shards - 1`` JSON Lines shards and one JSON list), its images and
    the demo tokenizer into ``out_dir``; returns ``out_dir``."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = list(_records(random.Random(seed), out / "images", samples))
    per_shard = -(-len(records) // shards)
    for s in range(shards):
        part = records[s * per_shard:(s + 1) * per_shard]
        if s == shards - 1:
            (out / f"part-{s:04d}.json").write_text(json.dumps(part, indent=1) + "\n")
        else:
            (out / f"part-{s:04d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    texts = [m["content"].replace("<image>", "") for r in records for m in r["messages"]]
    train_demo_tokenizer(texts + ["system\nuser\nassistant\nYou are a helpful assistant."], out / DEMO_TOKENIZER_FILE)
    return out
