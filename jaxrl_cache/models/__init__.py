"""The policy model: config, the model-family registry, the decoder every registered family
runs (dense and paged forwards), Hugging Face checkpoints, PEFT adapters and tokenizers in and
out."""
from jaxrl_cache.models.config import ModelConfig, RopeScaling
from jaxrl_cache.models.families import FAMILIES, Family, family_for_architecture, family_of
from jaxrl_cache.models.hf import from_pretrained, save_pretrained
from jaxrl_cache.models.llama import (DecoderLM, copy_pages, decode_forward, forward, init_kv_cache,
                                      init_params, prefill_forward)
from jaxrl_cache.models.lora import LoraConfig
from jaxrl_cache.models.peft import save_peft_adapter
from jaxrl_cache.models.tokenizer import Tokenizer, load_tokenizer

__all__ = ["FAMILIES", "Family", "LoraConfig", "ModelConfig", "RopeScaling", "DecoderLM",
           "Tokenizer", "copy_pages", "decode_forward", "family_for_architecture", "family_of",
           "forward", "from_pretrained", "init_kv_cache", "init_params", "load_tokenizer",
           "prefill_forward", "save_peft_adapter", "save_pretrained"]
