"""The policy model: config, the Llama-family decoder (dense and paged forwards)."""
from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.llama import (DecoderLM, copy_pages, decode_forward, forward, init_kv_cache,
                                      init_params, prefill_forward)

__all__ = ["ModelConfig", "DecoderLM", "copy_pages", "decode_forward", "forward", "init_kv_cache",
           "init_params", "prefill_forward"]
