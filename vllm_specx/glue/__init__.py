"""vLLM glue: the plugin's patches, config seam and runner hooks (all vLLM imports live here)."""
