"""jaxrl_cache: attributable RL post-training."""
