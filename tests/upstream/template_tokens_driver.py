"""The plugin's and MindSpeed-MM's token ids and labels for the same records, under one chat template.

Run by ``test_template_tokens.py`` (beside it) in a subprocess, never imported by pytest:
``python template_tokens_driver.py CORPUS PROCESSOR_DIR TEMPLATE[,TEMPLATE...] COUNT OUT.pt`` with the
job's import-only torchvision stand-in and the pinned MindSpeed-MM on ``PYTHONPATH`` (the
processor needs the first; upstream's template code the second).

Upstream's side is its own code end to end: ``get_template_and_fix_tokenizer`` (the
template by name, the tokenizer's EOS replaced as the job does) and
``SupervisedDatasetProcessor._encode_data_example`` (the per-record step of the dataset's
``preprocess_dataset``: the template's multimodal plugin expands each ``<image>`` with the
processor's image token count, then the template encodes the turns and masks the prompts),
fed what upstream's ``mllm_format`` conversion gives it for these records (the user turn as
prompt, the assistant turn as response, no system, the image paths).  The plugin's side is
``FlowDataLoader`` over the corpus with the same processor and ``template=``, one record
per loader, in file order.  Writes, per template,
``{template: {"plugin": [(ids, labels)], "upstream": [(ids, labels)]}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import realjob_qwen3vl_assets  # beside this file


def plugin_tokens(corpus: Path, processor, template: str, count: int) -> list[tuple[list[int], list[int]]]:
    """Each record's ``(input_ids, labels)`` from the plugin's loader (one record per pack)."""
    from mindspeed_flow.data import FlowDataLoader

    out = []
    for index in range(count):
        loader = FlowDataLoader(corpus, processor, capacity=4096, num_workers=0, shuffle=False, window=1,
                                image_root=corpus.parent, records=[index], template=template)
        [pack] = list(loader)
        real = pack["attention_mask"][0].bool()  # no padding at pad_multiple 1; kept exact anyway
        out.append((pack["input_ids"][0][real].tolist(), pack["labels"][0][real].tolist()))
    return out


def upstream_tokens(corpus: Path, processor_dir: str, template_name: str,
                    count: int) -> list[tuple[list[int], list[int]]]:
    """Each record's ``(input_ids, labels)`` from MindSpeed-MM's template and dataset processor,
    tokenizer and processor loaded by its own ``load_tokenizer`` as the job's data config sets it
    (``use_fast_tokenizer: false``, the processor's pixel bounds)."""
    from mindspeed_mm.data.data_utils.func_utils.convert import SupervisedDatasetProcessor, load_tokenizer
    from mindspeed_mm.data.data_utils.func_utils.model_args import ProcessorArguments
    from mindspeed_mm.data.data_utils.func_utils.template import get_template_and_fix_tokenizer

    loaded = load_tokenizer(ProcessorArguments(model_name_or_path=processor_dir, use_fast_tokenizer=False,
                                               image_max_pixels=realjob_qwen3vl_assets.MAX_PIXELS,
                                               image_min_pixels=realjob_qwen3vl_assets.MIN_PIXELS))
    tokenizer, processor = loaded["tokenizer"], loaded["processor"]
    template = get_template_and_fix_tokenizer(tokenizer, template_name)
    data_args = SimpleNamespace(cutoff_len=4096, mask_history=False, train_on_prompt=False, use_pmcc_data=False)
    encoder = SupervisedDatasetProcessor(template=template, tokenizer=tokenizer, processor=processor,
                                         data_args=data_args)
    records = json.loads(corpus.read_text())[:count]
    out = []
    for record in records:
        user, assistant = record["messages"]
        ids, labels = encoder._encode_data_example(
            prompt=[{"role": "user", "content": user["content"]}],
            response=[{"role": "assistant", "content": assistant["content"]}],
            system=None, images=[str(corpus.parent / p) for p in record["images"]], videos=[], audios=[], tools=[])
        out.append((list(ids), list(labels)))
    return out


def main() -> None:
    from mindspeed_flow.adapters.mindspeed_mm.data import load_processor

    corpus, processor_dir, templates, count, out = sys.argv[1:6]
    corpus_path, count = Path(corpus), int(count)
    result = {template: {"plugin": plugin_tokens(corpus_path, load_processor(processor_dir), template, count),
                         "upstream": upstream_tokens(corpus_path, processor_dir, template, count)}
              for template in templates.split(",")}
    torch.save(result, out)


if __name__ == "__main__":
    sys.exit(main())
