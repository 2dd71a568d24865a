"""Export every tier of a nested model to ONNX, verified, with a ``manifest.json``.

For every tier the slim module (with that tier's step sizes and norms) is taken from
:meth:`CompiledTier.load` and put in eval mode. Its BatchNorms are folded into the preceding
convolutions where that leaves the output unchanged, and its inner channels are optionally
zero-padded to an aligned width (:func:`pad_channels`). ``torch.onnx.export`` (the
torch.export path) then writes it as one self-contained ``.onnx`` file. onnxruntime's output
is checked against the PyTorch module on a random batch and the latency is measured. INT8
and FP16 versions are made from that FP32 file and checked against it; the manifest
(:mod:`nefl_zoo.manifest`) records what every (tier, precision) costs.

One job per module:

    sources     what to export: a spec (random or --pretrained weights) or a training run
                directory (spec.yaml, global.safetensors, metrics.jsonl, config.yaml)
    surgery     rewrites that keep the output: fold_batchnorm, pad_channels
    onnx_file   torch.onnx.export into one file, activation size, machine description
    verify      one self-contained file, its sha256, parity with PyTorch (ATOL), and a
                quantized file's agreement with FP32
    data        the images INT8 is calibrated on and quantized files are checked on
    quantize    INT8 (onnxruntime static quantization, QDQ) and FP16 files from FP32
    fp32        one tier's FP32 file: folded, padded, written, verified and timed
    precisions  one tier's files at every precision: checked, measured, timed together
    staging     the locked staging folder, and publishing files and manifest
    options     ExportOptions: what to export and how (the settings of ``nefl-zoo export``)
    tiers       export_tiers: the above for every tier
    mobile      an export's nested models in onnxruntime's ORT format (``convert-ort``)
"""

from ..data.datasets import CIFAR10_CLASSES, CLASS_NAMES, NORMALIZATION
from ..runtime.latency import machine_description
from .mobile import convert_to_ort
from .onnx_file import (
    INPUT_NAME,
    MIN_OPSET,
    OUTPUT_NAME,
    activation_bytes_per_sample,
    tier_filename,
    write_onnx,
)
from .sources import DATASETS, ExportSource, check_global_state, load_run_dir, load_source, read_accuracy, read_dataset
from .surgery import fold_batchnorm, pad_channels
from .options import CALIBRATION_IMAGES, ExportOptions
from .tiers import export_tiers
from .verify import ATOL, ExportError, check_parity, check_single_file, tolerance_for

__all__ = [
    "ATOL",
    "CALIBRATION_IMAGES",
    "CIFAR10_CLASSES",
    "CLASS_NAMES",
    "DATASETS",
    "INPUT_NAME",
    "MIN_OPSET",
    "NORMALIZATION",
    "OUTPUT_NAME",
    "ExportError",
    "ExportOptions",
    "ExportSource",
    "activation_bytes_per_sample",
    "check_global_state",
    "check_parity",
    "check_single_file",
    "convert_to_ort",
    "export_tiers",
    "fold_batchnorm",
    "load_run_dir",
    "load_source",
    "machine_description",
    "pad_channels",
    "read_accuracy",
    "read_dataset",
    "tier_filename",
    "tolerance_for",
    "write_onnx",
]
