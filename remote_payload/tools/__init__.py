"""Developer tools: benchmarks, the offline fixture builder, the results-schema docs generator."""
