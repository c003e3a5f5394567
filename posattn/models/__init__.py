"""Encoder and decoder models, their configuration, and checkpoint I/O."""
from .config import ModelConfig
from .io import from_yaml, is_checkpoint, load, save
from .transformer import Decoder, Encoder, Transformer, build_model

__all__ = ["ModelConfig", "Encoder", "Decoder", "Transformer", "build_model", "save", "load",
           "from_yaml", "is_checkpoint"]
