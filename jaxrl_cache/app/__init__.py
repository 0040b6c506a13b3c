"""User-facing programs: the GRPO demo, its tasks, and the `jaxrl-cache` CLI."""
