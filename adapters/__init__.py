"""What an adapter is: LoRA config, multi-adapter math and layer, injection, PEFT-format files.

Imports only torch and safetensors: the bottom layer of ARCHITECTURE.md.
"""

from adapters.config import AdapterError, LoraConfig
from adapters.context import AdapterContext, AdapterWeights, TokenRouting, weight_matrix
from adapters.device import module_device
from adapters.export import concat_adapters, export_mixture
from adapters.inject import AdaptedModel, inject
from adapters.io import load_adapter, read_adapter_config, read_adapter_folder, save_adapter, write_adapter_folder
from adapters.layer import LoraAdapter, MultiLoraLinear

__all__ = [
    "AdaptedModel",
    "AdapterContext",
    "AdapterError",
    "AdapterWeights",
    "LoraAdapter",
    "LoraConfig",
    "MultiLoraLinear",
    "TokenRouting",
    "concat_adapters",
    "export_mixture",
    "inject",
    "load_adapter",
    "module_device",
    "read_adapter_config",
    "read_adapter_folder",
    "save_adapter",
    "weight_matrix",
    "write_adapter_folder",
]
