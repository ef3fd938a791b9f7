"""Checkpoints: HF GPT-OSS directories (bf16 safetensors, MXFP4 experts) <-> our model.

names    the one declarative table between our parameter names/layouts and HF's
convert  streams of HF-named tensors from and into a model (fused QKV assembled on the fly)
hf       load_hf / save_hf of whole directories: sharded safetensors, index, config.json
mxfp4    the MXFP4 expert-weight format: dequantize (import) and quantize (test checkpoints)
"""

from megatron_gptoss.checkpoint.convert import CheckpointError, iter_hf_tensors, load_hf_tensors
from megatron_gptoss.checkpoint.hf import load_hf, read_config, save_hf
from megatron_gptoss.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4

__all__ = [
    "CheckpointError",
    "dequantize_mxfp4",
    "iter_hf_tensors",
    "load_hf",
    "load_hf_tensors",
    "quantize_mxfp4",
    "read_config",
    "save_hf",
]
