"""Step 1, the model: takes an ``nn.Module`` (or a ready layer list) and gives its chain.

The chain is the ordered list of named :class:`Layer` objects that profiling, planning and
running share, with skip edges declared by ``@skippable`` stash/pop.  ``nn.Sequential`` and
torchvision ResNets are read directly; any other model is captured with torch.fx or
torch.export (:func:`chain`).  Fingerprints let later steps refuse a profile or plan made for
another model.
"""
from .capture import CaptureError, CapturedLayer, chain
from .fingerprint import environment_fingerprint, first_difference, model_fingerprint
from .layers import ChainError, Layer
from .reading import call_arguments, layer_chain, sample_arguments
from .skip import Namespace, SkipKey, pop, skippable, stash, verify_skippables

__all__ = [
    "CaptureError", "CapturedLayer", "ChainError", "Layer", "Namespace", "SkipKey", "call_arguments", "chain",
    "environment_fingerprint", "first_difference", "layer_chain", "model_fingerprint", "sample_arguments", "pop",
    "skippable", "stash", "verify_skippables",
]
