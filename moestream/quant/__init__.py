"""Quantized experts: codecs by quantization method (`CODECS`, contract in `codec.py`). Importing this package
imports every codec module in it, so that each registers itself."""

import sys

from moestream.quant.codec import CODECS, ExpertCodec, codec_for, method_of, quantization_config
from moestream.registry import import_submodules

import_submodules(sys.modules[__name__])

__all__ = ["CODECS", "ExpertCodec", "codec_for", "method_of", "quantization_config"]
