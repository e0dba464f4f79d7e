"""Fixtures, not the product: models built from config with random weights (`model_zoo`), used by the test
suite, the benchmarks, `memplan demo` and `memplan profile --model` to have real models without downloads.
Nothing here is used to plan a real job."""
