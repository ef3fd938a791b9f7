"""HF GPT-OSS formats <-> our model: the name table, tensor streams, MXFP4, whole directories.

names    the one declarative table between our parameter names/layouts and HF's
convert  streams of HF-named tensors from and into a model (fused QKV assembled on the fly)
io       load_hf / save_hf of whole directories: sharded safetensors, index, config.json; shard readers
mxfp4    the MXFP4 expert-weight format: dequantize (import) and quantize (MXFP4 export, weight sync)
"""

from megatron_gptoss.hf.convert import iter_hf_tensors, load_hf_tensors
from megatron_gptoss.hf.io import load_hf, read_config, save_hf
from megatron_gptoss.hf.mxfp4 import dequantize_mxfp4, quantize_mxfp4

__all__ = [
    "dequantize_mxfp4",
    "iter_hf_tensors",
    "load_hf",
    "load_hf_tensors",
    "quantize_mxfp4",
    "read_config",
    "save_hf",
]
