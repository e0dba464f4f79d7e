"""What-if planning: plans for a model on hardware it has never run on, from its config and a catalogue entry.

`catalog` (the hardware catalogue), `architecture` (a Hugging Face config -> a model of fake tensors, its
blocks), `fake_iteration` (one training iteration on fake tensors: memory, FLOPs, bytes per block),
`roofline` (FLOPs and bytes -> seconds on a catalogue entry), `modelled_trace` (all of it -> a wire-contract
Trace marked modelled), `retarget` (a measured trace's times moved to another entry), `answer` (trace ->
solver -> fits / binding limit / speed) and `cli` (`memplan whatif`, `memplan hardware catalog`).
torch and transformers are imported inside the functions that need them.
"""
