"""kvbench: the bulk data plane benchmark (not NIXL's KVBench) and its agent processes."""
