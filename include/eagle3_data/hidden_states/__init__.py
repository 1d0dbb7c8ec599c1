"""EAGLE-3 hidden states: extraction backends, packed shards, readers, exporters, fp8."""
