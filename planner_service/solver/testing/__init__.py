"""Fixtures, not the product: synthetic traces with modelled (not measured) numbers (`synthetic`), for the
solver's tests, the benchmarks and the demo. A synthetic trace is never used to plan a real job."""
