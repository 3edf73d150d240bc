"""Flax decoder-only models (Llama 2, Llama 3.2, Qwen2.5, Qwen3, DeepSeek-V2 MLA) with
Hugging Face parameter names, configs, checkpoint conversion and model directories."""

from models.configs import FAMILIES, PRESETS, ModelConfig, get_config, list_configs
from models.hf import config_from_hf, from_hf, to_hf, to_hf_config
from models.hf_files import architecture, load_hf_params, read_hf_config, write_hf_dir
from models.layers import attention_implementation
from models.model import (
    CausalLM,
    abstract_params,
    build_model,
    check_tokens,
    cross_entropy,
    forward,
    head_kernel,
    hidden_states,
    init_params,
    logical_axes,
    param_count,
    token_nll,
)

__all__ = [
    "FAMILIES",
    "PRESETS",
    "CausalLM",
    "ModelConfig",
    "abstract_params",
    "architecture",
    "attention_implementation",
    "build_model",
    "check_tokens",
    "config_from_hf",
    "cross_entropy",
    "forward",
    "from_hf",
    "get_config",
    "head_kernel",
    "hidden_states",
    "init_params",
    "list_configs",
    "load_hf_params",
    "logical_axes",
    "param_count",
    "read_hf_config",
    "to_hf",
    "to_hf_config",
    "token_nll",
    "write_hf_dir",
]
