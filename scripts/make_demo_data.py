"""Write the demo multimodal corpus (MindSpeed-MM format) and its trained BPE tokenizer.

    python scripts/make_demo_data.py [--out outputs/demo_data] [--samples 400] [--seed 0]

Then ``FlowDataLoader("outputs/demo_data", None, ...)`` reads it with the demo tokenizer.
"""

from __future__ import annotations

import argparse

from mindspeed_flow.data.demo import make_demo_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo_data")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    out = make_demo_corpus(args.out, args.samples, args.seed, args.shards)
    print(f"wrote {args.samples} records in {args.shards} shards, images and flow_demo_tokenizer.json to {out}")


if __name__ == "__main__":
    main()
