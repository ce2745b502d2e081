"""IMPORT-ONLY STAND-IN for ``torchvision``, for mindspeed-flow's real-job harness only.

Why: the only torchvision wheel the registry serves for torch 2.13 is a CUDA build whose
compiled part does not load on CPU (``operator torchvision::nms does not exist`` at import).
MindSpeed-MM's data package and ``transformers``' Qwen2.5-VL processor import torchvision names
at module level; the real job's image path uses none of them (MindSpeed-MM's Qwen2-VL plugin
and the slow ``Qwen2VLImageProcessor`` work on PIL / numpy).  ``transformers`` only builds the
Qwen2.5-VL video processor class when torchvision's distribution metadata is found, hence the
``dist-info`` beside this package.

Every name below exists so that imports succeed; calling any function or building any class
raises ``NotImplementedError`` naming it, so a run that really needed torchvision fails loudly
instead of computing something else.  No catch-all ``__getattr__``: the module list is explicit
(``STOOD_IN``), printed by the harness.
"""

import enum
import sys
import types

__version__ = "0.28.0+standin"
STANDIN = True
STOOD_IN: list = []


def _raiser(qualname: str):
    def stood_in(*args, **kwargs):
        raise NotImplementedError(f"{qualname}: torchvision is an import-only stand-in in this harness")

    stood_in.__qualname__ = stood_in.__name__ = qualname.rsplit(".", 1)[-1]
    return stood_in


def _class(qualname: str):
    name = qualname.rsplit(".", 1)[-1]
    return type(name, (), {"__init__": lambda self, *a, **k: _raiser(qualname)(), "__module__": qualname.rsplit(".", 1)[0]})


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's values (transformers maps PIL modes onto them)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# module -> (functions, classes) named by upstream imports on the real job's path
MODULES = {
    "torchvision": (["get_video_backend", "set_video_backend", "get_image_backend", "set_image_backend"], []),
    "torchvision.transforms": ([], ["Compose", "Lambda", "Normalize", "Resize", "ToTensor", "CenterCrop",
                                    "RandomCrop", "RandomResizedCrop", "RandomHorizontalFlip", "ToPILImage",
                                    "ColorJitter", "Pad", "Grayscale", "RandomApply"]),
    "torchvision.transforms.functional": (["resize", "center_crop", "normalize", "to_tensor", "pil_to_tensor",
                                           "to_pil_image", "crop", "pad", "hflip", "rotate", "resized_crop",
                                           "get_image_size", "convert_image_dtype", "_interpolation_modes_from_int"],
                                          []),
    "torchvision.transforms.v2": ([], ["Compose", "Lambda", "Normalize", "Resize", "ToTensor", "CenterCrop",
                                       "RandomResizedCrop", "ToDtype", "ToImage"]),
    "torchvision.transforms.v2.functional": (["resize", "center_crop", "normalize", "to_tensor", "pil_to_tensor",
                                              "to_pil_image", "crop", "pad", "grayscale_to_rgb", "to_dtype",
                                              "rgb_to_grayscale", "to_image"], []),
    "torchvision.transforms.v2.functional._utils": (["_register_kernel_internal"], []),
    "torchvision.transforms.v2.functional._misc": (["normalize"], []),
    "torchvision.transforms._functional_tensor": (["resize"], []),
    "torchvision.io": (["read_video", "read_image", "decode_image", "decode_jpeg", "write_video", "read_file"],
                       ["VideoReader"]),
    "torchvision.io._video_opt": (["_read_video", "_probe_video_from_file", "_read_video_timestamps"], []),
    "torchvision.io.video": (["read_video", "read_video_timestamps", "write_video", "_read_from_stream",
                              "_check_av_available", "_align_audio_frames"], []),
    "torchvision.datasets": ([], ["ImageFolder", "DatasetFolder"]),
    "torchvision.datasets.folder": (["pil_loader", "default_loader", "make_dataset"], ["ImageFolder"]),
    "torchvision.tv_tensors": ([], ["Image", "Video", "BoundingBoxes", "Mask"]),
    "torchvision.models": (["resnet50", "vgg16", "get_model"], []),
    "torchvision.ops": (["nms", "box_iou", "roi_align"], []),
    "torchvision.utils": (["save_image", "make_grid"], []),
}


def _build() -> None:
    this = sys.modules[__name__]
    for name, (functions, classes) in MODULES.items():
        module = this if name == __name__ else types.ModuleType(name, f"import-only stand-in for {name}")
        if module is not this:
            module.__path__ = []  # a package: its submodules are in sys.modules
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
        for fn in functions:
            setattr(module, fn, _raiser(f"{name}.{fn}"))
        for cls in classes:
            setattr(module, cls, _class(f"{name}.{cls}"))
        STOOD_IN.append(name)
    for name in ("torchvision.transforms", "torchvision.transforms.functional", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        sys.modules[name].InterpolationMode = InterpolationMode
    sys.modules["torchvision.datasets.folder"].IMG_EXTENSIONS = IMG_EXTENSIONS
    sys.modules["torchvision.io.video"]._video_opt = sys.modules["torchvision.io._video_opt"]
    sys.modules["torchvision.transforms.v2.functional._utils"]._KERNEL_REGISTRY = {}


_build()
