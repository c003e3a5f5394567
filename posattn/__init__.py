"""posattn: positional information inside attention, every mechanism behind one layer."""
from .errors import PositionError
from .mechanisms import Spec, names
from .models import Decoder, Encoder, ModelConfig, build_model, load, save

__version__ = "0.1.0"
__all__ = ["PositionError", "Spec", "names", "Encoder", "Decoder", "ModelConfig", "build_model",
           "load", "save", "__version__"]
