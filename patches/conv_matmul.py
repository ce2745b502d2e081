"""Feature ``conv_matmul`` (``--flow-conv-matmul``): ViT patch embeddings as a matmul.

The stride == kernel convolutions of Qwen2-VL's ``PatchEmbed`` (Conv3d), CLIP's ``conv1``
(Conv2d) and, on ``pretrain_transformers.py``'s path, the Hugging Face Qwen3-VL ViT's
``Qwen3VLVisionPatchEmbed.proj`` (Conv3d) are replaced right after construction by
:class:`~mindspeed_flow.attention.patch_embed.PatchEmbedMatmul`, which keeps the conv's
parameters in the conv's shape: checkpoints (model and optimizer, ``torch``, ``torch_dist`` and
``torch_dcp``, and the Hugging Face safetensors the Qwen3-VL path loads and saves) are the
same with and without the flag.  The Hugging Face ViT's conv keeps its type and gets the
matmul forward (:class:`~mindspeed_flow.attention.patch_embed.MatmulConv3d`), so HF's
from-scratch init (``post_init`` / ``init_weights``, by ``isinstance``) treats it as upstream's:
the weights of a seeded model built without a checkpoint are upstream's, bit for bit.
``mindspeed-flow
convert-patch-embed`` converts the flat-layout checkpoints of earlier versions.
"""

from mindspeed_flow.adapters.mindspeed_mm import model as mindspeed_mm
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MINDSPEED_MM, source

FEATURE = "conv_matmul"
CHECKED_MM = (source(MINDSPEED_MM),)

PATCHES = [
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vision.vision_encoders.qwen2vl_vit_model:PatchEmbed.__init__",
        wrapper=mindspeed_mm.swap_conv_after_init("proj"),
        params="self, patch_size, temporal_patch_size, in_channels, embed_dim, bias",
        checked=CHECKED_MM,
        description="Qwen2-VL / Qwen2.5-VL / Qwen3-VL PatchEmbed.proj Conv3d -> matmul",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vision.vision_encoders.clip_vit_model:CLIPViT.__init__",
        wrapper=mindspeed_mm.swap_conv_after_init("conv1"),
        params="self, config, transformer_layer_spec, pre_process, post_process",
        checked=CHECKED_MM,
        optional=True,
        description="CLIP ViT conv1 Conv2d -> matmul",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.transformers.qwen3vl.modules:Qwen3VLVisionPatchEmbed.__init__",
        wrapper=mindspeed_mm.swap_conv_after_init("proj", keep_conv_type=True),
        params="self, config",
        checked=CHECKED_MM,
        description="Qwen3-VL (pretrain_transformers.py, HF ViT) Qwen3VLVisionPatchEmbed.proj Conv3d with a matmul forward",
    ),
]
