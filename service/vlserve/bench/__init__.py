"""Benchmarks: a load generator for OpenAI-compatible endpoints, the naive-vs-tuned comparison,
the plan-vs-best sweep and the memory-bandwidth bound. Every figure is a median or a percentile,
and every claim is a ratio against a baseline measured in the same run."""
